"""``bench.nanogpt`` at test size: nanoGPT's ``train.py`` is a tiny copy of its loop written here (nanoGPT's command
line, configurator, data files and output lines; a bigram model), purestep's side the real ``recipe=standard``,
uncompiled; the reach times against a hand computation; nanoGPT's data against its ``prepare.py``; a bad path."""
import json
import pickle
import textwrap

import numpy as np
import pytest

from purestep.recipes import main
from purestep.recipes.bench import nanogpt

# nanoGPT's configurator.py (commit 3adf61e), its logic: a config file, then --key=value overrides of known keys.
CONFIGURATOR = '''
import sys
from ast import literal_eval
for arg in sys.argv[1:]:
    if '=' not in arg:
        assert not arg.startswith('--')
        exec(open(arg).read())
    else:
        assert arg.startswith('--')
        key, val = arg.split('=')
        key = key[2:]
        if key not in globals():
            raise ValueError(f"Unknown config key: {key}")
        try:
            attempt = literal_eval(val)
        except (SyntaxError, ValueError):
            attempt = val
        assert type(attempt) == type(globals()[key])
        globals()[key] = attempt
'''
CONFIG = '''
out_dir = 'out-shakespeare-char'
eval_interval = 250
eval_iters = 200
log_interval = 10
always_save_checkpoint = False
dataset = 'shakespeare_char'
batch_size = 64
block_size = 256
n_layer = 6
n_head = 6
n_embd = 384
dropout = 0.2
learning_rate = 1e-3
max_iters = 5000
lr_decay_iters = 5000
'''
MODEL = '''
import torch
import torch.nn.functional as F

class Bigram(torch.nn.Module):
    def __init__(self, vocab_size):
        super().__init__()
        self.table = torch.nn.Embedding(vocab_size, vocab_size)

    def forward(self, idx, targets):
        logits = self.table(idx)
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
'''
# nanoGPT's train.py loop, its keys, files and prints; a bigram model instead of its GPT.
TRAIN = '''
import json, os, pickle, time
import numpy as np
import torch
from model import Bigram

out_dir = 'out'; eval_interval = 2000; log_interval = 1; eval_iters = 200; always_save_checkpoint = True
dataset = 'openwebtext'; gradient_accumulation_steps = 1; batch_size = 12; block_size = 1024
n_layer = 12; n_head = 12; n_embd = 768; dropout = 0.0; learning_rate = 6e-4; max_iters = 600000
lr_decay_iters = 600000; device = 'cuda'; compile = True
config_keys = [k for k, v in globals().items() if not k.startswith('_') and isinstance(v, (int, float, bool, str))]
exec(open('configurator.py').read())
config = {k: globals()[k] for k in config_keys}
print(f"tokens per iteration will be: {gradient_accumulation_steps * batch_size * block_size:,}")
os.makedirs(out_dir, exist_ok=True)
json.dump(config, open(os.path.join(out_dir, 'config.json'), 'w'))
torch.manual_seed(1337)
data_dir = os.path.join('data', dataset)
def get_batch(split):
    data = np.memmap(os.path.join(data_dir, f'{split}.bin'), dtype=np.uint16, mode='r')
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([torch.from_numpy((data[i:i+block_size]).astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy((data[i+1:i+1+block_size]).astype(np.int64)) for i in ix])
    return x, y
meta = pickle.load(open(os.path.join(data_dir, 'meta.pkl'), 'rb'))
model = Bigram(meta['vocab_size'])
optimizer = torch.optim.AdamW(model.parameters(), lr=0.3)
if compile:
    model = torch.compile(model)
@torch.no_grad()
def estimate_loss():
    out = {}
    for split in ['train', 'val']:
        out[split] = sum(model(*get_batch(split))[1].item() for _ in range(eval_iters)) / eval_iters
    return out
iter_num, best_val_loss = 0, 1e9
X, Y = get_batch('train')
t0 = time.time()
while True:
    if iter_num % eval_interval == 0:
        losses = estimate_loss()
        print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        if losses['val'] < best_val_loss:
            best_val_loss = losses['val']
            torch.save(model.state_dict(), os.path.join(out_dir, 'ckpt.pt'))
    logits, loss = model(X, Y)
    X, Y = get_batch('train')
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    t1 = time.time(); dt = t1 - t0; t0 = t1
    if iter_num % log_interval == 0:
        print(f"iter {iter_num}: loss {loss.item():.4f}, time {dt*1000:.2f}ms, mfu -100.00%")
    iter_num += 1
    if iter_num > max_iters:
        break
'''


def fake_checkout(root):
    """A folder laid out as a nanoGPT checkout, running the loop above."""
    (root / "config").mkdir(parents=True)
    for name, text in (("configurator.py", CONFIGURATOR), ("model.py", MODEL), ("train.py", TRAIN),
                       (nanogpt.CONFIG_FILE, CONFIG)):
        (root / name).write_text(textwrap.dedent(text))
    return root


def nanogpt_prepare(text: str) -> tuple[bytes, bytes, dict]:
    """nanoGPT's data/shakespeare_char/prepare.py on ``text``: its train.bin and val.bin bytes and its meta."""
    chars = sorted(list(set(text)))
    stoi = {ch: i for i, ch in enumerate(chars)}
    n = len(text)
    train = np.array([stoi[c] for c in text[:int(n * 0.9)]], dtype=np.uint16)
    val = np.array([stoi[c] for c in text[int(n * 0.9):]], dtype=np.uint16)
    return train.tobytes(), val.tobytes(), {"vocab_size": len(chars), "itos": dict(enumerate(chars)), "stoi": stoi}


def test_reach_time_is_linear_between_the_evaluations_around_the_target():
    evals = [(10.0, 0, 4.0), (20.0, 250, 3.0), (40.0, 500, 2.0), (50.0, 750, 1.5)]
    # 2.5 lies halfway from 3.0 (20 s) to 2.0 (40 s)
    assert nanogpt.reach_time(evals, 2.5) == {"s": 30.0, "step": 500}
    # 1.6 is 4/5 of the way from 2.0 (40 s) to 1.5 (50 s)
    assert nanogpt.reach_time(evals, 1.6) == pytest.approx({"s": 48.0, "step": 750})
    assert nanogpt.reach_time(evals, 3.0) == {"s": 20.0, "step": 250}     # at or below: that evaluation's time
    assert nanogpt.reach_time(evals, 5.0) == {"s": 10.0, "step": 0}       # the first evaluation already
    assert nanogpt.reach_time(evals, 1.0) is None
    nano = {"wall_s": 60.0, "tokens_per_s": 1000.0, "val_loss": 2.5, "evals": [(5.0, 0, 4.2), (55.0, 500, 2.5)]}
    pure = {"wall_s": 45.0, "tokens_per_s": 1500.0, "val_loss": 1.5, "evals": evals}
    p = nanogpt.pair("warm", 0, nano, pure)
    assert p["purestep"]["reaches_other"] == {"s": 30.0, "step": 500} and p["nanogpt"]["reaches_other"] is None
    assert (p["wall_ratio"], p["tokens_ratio"]) == (0.75, 1.5)


def test_nanogpt_data_is_what_its_prepare_py_writes(tmp_path, token_cache):
    text = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n" * 30
    (tmp_path / "input.txt").write_text(text)
    folder = nanogpt.prepare_nanogpt_data(tmp_path / "input.txt", tmp_path / "data")
    train, val, meta = nanogpt_prepare(text)
    assert (folder / "train.bin").read_bytes() == train and (folder / "val.bin").read_bytes() == val
    assert pickle.loads((folder / "meta.pkl").read_bytes()) == meta


def test_the_bench_runs_both_sides_taking_turns_and_tabulates_them(tmp_path, token_cache, capsys):
    root = fake_checkout(tmp_path / "nanoGPT")
    corpus = tmp_path / "input.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    cfg = nanogpt.Config(nanogpt=str(root), data=str(corpus), n_layers=1, d_model=32, batch_size=4, block_size=16,
                         steps=101, eval_every=50, eval_batches=2, repeats=1, compile=False, out=str(tmp_path / "b"))
    result = nanogpt.run(cfg)
    pairs = result["pairs"]
    assert [(p["cache"], p["repeat"]) for p in pairs] == [("cold", 0), ("warm", 0)]
    for p in pairs:
        for side in ("nanogpt", "purestep"):
            r = p[side]
            assert r["wall_s"] > 0 and r["tokens_per_s"] > 0 and r["peak_rss_mib"] > 10, (side, r)
            assert 0 < r["val_loss"] < 10 and r["val_loss"] == r["evals"][-1][2]
            assert [step for _, step, _ in r["evals"]] == ([0, 50, 100] if side == "nanogpt" else [50, 100, 101])
            seconds = [s for s, _, _ in r["evals"]]
            assert seconds == sorted(seconds) and seconds[-1] < r["wall_s"]
            other = p["purestep" if side == "nanogpt" else "nanogpt"]["val_loss"]
            assert r["reaches_other"] == nanogpt.reach_time(r["evals"], other)
        assert p["wall_ratio"] == p["purestep"]["wall_s"] / p["nanogpt"]["wall_s"]
    ran = json.loads((tmp_path / "b" / "nanogpt-cold-0" / "config.json").read_text())
    assert (ran["device"], ran["compile"], ran["eval_iters"], ran["eval_interval"], ran["log_interval"]) == \
        ("cpu", False, 2, 50, 1)
    assert (ran["n_layer"], ran["n_embd"], ran["block_size"], ran["batch_size"], ran["max_iters"],
            ran["lr_decay_iters"], ran["dropout"], ran["learning_rate"]) == (1, 32, 16, 4, 101, 101, 0.0, 1e-3)
    assert (tmp_path / "b" / "nanogpt-warm-0" / "ckpt.pt").exists()
    assert (tmp_path / "b" / "purestep-warm-0" / "final.msgpack").exists()
    out = capsys.readouterr().out
    assert "the same precision (fp32" in out
    for row in ("| 1, cold | nanogpt |", "| 1, cold | purestep |", "| 1, warm | purestep / nanoGPT |",
                "| median, cold | purestep / nanoGPT |", "| median, warm | purestep / nanoGPT |"):
        assert row in out, row
    table = [line for line in out.splitlines() if line.startswith("| ")]
    assert len(table) == 1 + 2 * 3 + 2 and all(line.count("|") == 8 for line in table)
    assert json.loads((tmp_path / "b" / "results.json").read_text())["medians"].keys() == {"cold", "warm"}


def test_the_header_says_where_precisions_differ():
    assert "**precisions differ**: nanoGPT fp32" in nanogpt.header(nanogpt.Config(optimizer="muon", dtype="bf16"))


def test_steps_must_pass_nanogpts_warmup(capsys):
    """nanoGPT's ``get_lr`` divides by ``lr_decay_iters - warmup_iters`` (100 in its configuration)."""
    assert main(["recipe=bench.nanogpt", "nanogpt=nanoGPT", "steps=100"]) == 2
    assert "steps" in capsys.readouterr().err


def test_a_bad_nanogpt_path_says_how_to_get_one(tmp_path, capsys):
    (tmp_path / "train.py").write_text("")
    for path in ("", str(tmp_path / "absent"), str(tmp_path)):
        assert main(["recipe=bench.nanogpt", f"nanogpt={path}"]) == 2
        err = capsys.readouterr().err
        assert nanogpt.CLONE in err, err
    assert "no model.py, configurator.py, config/train_shakespeare_char.py" in err
