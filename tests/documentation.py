"""The documentation as the tests read it: README.md (the guide) and the reference pages under docs/ that it links.

Text the tests check (the research script, the generated key and exit-code tables, the study example, the commands
of shell blocks) may live on any of these pages; ``block`` finds a marked block wherever it is, and fails when it is
missing or marked twice."""
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]


def text() -> str:
    """Every page, the README first."""
    return "\n".join(page.read_text() for page in PAGES)


def block(name: str) -> tuple[Path, str]:
    """The page holding ``<!-- name:start -->`` ... ``<!-- name:end -->``, and the text between the markers."""
    found = [(page, match.group(1)) for page in PAGES
             for match in re.finditer(rf"<!-- {re.escape(name)}:start -->\n(.*?)<!-- {re.escape(name)}:end -->",
                                      page.read_text(), re.S)]
    assert len(found) == 1, f"the documentation has {len(found)} {name} blocks (README.md and docs/*.md); want one"
    return found[0]
