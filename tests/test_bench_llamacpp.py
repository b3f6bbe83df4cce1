"""``recipe=bench.llamacpp`` without llama.cpp: its one skip line, its checks of the keys, and the numbers it
reports computed on hand-made logits (the benchmark itself needs ``llama_cpp``, which purestep does not depend on,
and is run by hand: docs/export.md, "Measured in llama.cpp")."""
import math
import sys

import pytest
import torch

from purestep.recipes import main
from purestep.recipes.bench import llamacpp


def test_without_llama_cpp_it_says_so_in_one_line_and_loads_nothing(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)          # import llama_cpp raises ImportError
    assert llamacpp.find_llama_cpp() is None
    assert main(["recipe=bench.llamacpp", "init=/no/such/model"]) == 0   # skipped before init is read
    out = capsys.readouterr().out
    assert out == llamacpp.SKIP + "\n" and "llama_cpp is not importable" in out


@pytest.mark.parametrize("args, message", [
    (["dtypes=fp32,q4_0"], "error: dtypes: q4_0 not one of fp32, f16, bf16, q8_0\n"),
    (["tokens=32", "prompt_tokens=32"], "error: prompt_tokens=32 must be below tokens=32 (the prompt is the start "
                                        "of the compared window)\n"),
])
def test_bad_keys_are_one_line_and_exit_2(args, message, capsys):
    assert main(["recipe=bench.llamacpp", *args]) == 2
    assert capsys.readouterr().err == message


def test_the_reported_numbers_on_hand_made_logits():
    window = torch.tensor([0, 1, 2, 1])
    ours = torch.zeros(4, 3)                                  # uniform: NLL log 3 at every position
    theirs = ours.clone()
    theirs[0, 1], theirs[2, 2] = 0.5, -0.25                   # llama.cpp's top token moves at position 0 only
    row = llamacpp.compare({"logits": ours, "greedy": [5, 6, 7, 8]},
                           {"logits": theirs, "greedy": [5, 6, 9, 8], "ids": [1, 2]}, window, [1, 2])
    assert row["max_logit_diff"] == 0.5 and row["max_abs_logit"] == 0.0
    assert row["top1_agree"] == 0.75                          # argmax of a tie is the first index
    assert (row["greedy_shared"], row["greedy_of"], row["same_ids"]) == (2, 4, True)
    assert math.isclose(row["nll_purestep"], math.log(3), rel_tol=1e-12)
    by_hand = (-math.log(math.exp(0.5) / (2 + math.exp(0.5))) - math.log(1 / 3)
               - math.log(1 / (2 + math.exp(-0.25)))) / 3     # targets 1, 2, 1 at positions 0, 1, 2
    assert math.isclose(row["nll_llama_cpp"], by_hand, rel_tol=1e-12)
    assert llamacpp.shared_prefix([1, 2, 3], [1, 2, 3, 4]) == 3 and llamacpp.shared_prefix([], [1]) == 0
    table = llamacpp._table([{"export": "model-F32.gguf", **row}])
    assert table.splitlines()[-1] == ("| model-F32.gguf | 0.00 | 0.5 | 75.0% | 2/4 | 1.09861 | "
                                      f"{by_hand:.5f} | same ids |")
