"""The documentation's runnable blocks: a fenced ```python or ```bash block right after a line `<!-- runnable -->`
(invisible in the site), optionally `<!-- runnable expect="TEXT" ... -->` naming text its output must hold."""
import re

from helpers.paths import REPO

DOCS = REPO / "docs"
RUNNABLE = re.compile(r"^<!-- runnable((?: expect=\"[^\"]*\")*) -->\n```(python|bash)\n(.*?)^```", re.M | re.S)
EXPECT = re.compile(r'expect="([^"]*)"')
PAGES = sorted(p.name for p in DOCS.glob("*.md"))
# files a page includes where it says <!-- generated: NAME --> (docs/hooks.py): their blocks are the page's
INCLUDED = {"fairseq-readme": REPO / "integrations" / "fairseq_moe" / "README.md"}


def _with_included(text: str) -> str:
    return re.sub(r"<!-- generated: ([a-z-]+) -->",
                  lambda m: INCLUDED[m.group(1)].read_text(encoding="utf-8") if m.group(1) in INCLUDED else m.group(0),
                  text)


def runnable_blocks():
    """(id, language, code, the texts its output must hold) of every runnable block in docs/, in page order; the id
    is the page's name and the block's number on it ("fairseq-1"), counting the blocks of the files it includes."""
    blocks = []
    for name in PAGES:
        for number, match in enumerate(RUNNABLE.finditer(_with_included((DOCS / name).read_text(encoding="utf-8"))), 1):
            blocks.append((f"{name[:-3]}-{number}", match.group(2), match.group(3), EXPECT.findall(match.group(1))))
    return blocks
