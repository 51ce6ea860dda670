"""The documentation site (mkdocs.yml, docs/): it builds with `mkdocs build --strict`, its generated pages hold
what the code holds, every code block marked `<!-- runnable -->` runs as written, and the built pages render
with their navigation in headless Chromium (the MoEConfig table with its names whole). `pytest -k docs` selects
these tests.

A runnable block (helpers.docs_blocks: a fenced ```python or ```bash block right after a line `<!-- runnable -->`,
invisible in the site) runs as a script file in a fresh process in an empty folder, with OMP_NUM_THREADS=1 and the
repository root as REPO in its environment (commands that need the shipped configs use $REPO);
`<!-- runnable expect="TEXT" ... -->` also asks that each TEXT appear in the block's output.
"""
import dataclasses
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.docs_blocks import DOCS, PAGES, runnable_blocks
from helpers.paths import REPO, load_script

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _hooks():
    return load_script("docs/hooks.py")


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site built once for this module's tests, as CI builds it."""
    pytest.importorskip("mkdocs", reason="the docs extra is not installed (pip install -e '.[docs]')")
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}"
    return out


@pytest.mark.spawns
def test_docs_build_strict_with_every_page_and_the_generated_reference(site):
    from moe_plugin.config import MoEConfig

    for name in PAGES:
        page = site / ("index.html" if name == "index.md" else f"{name[:-3]}/index.html")
        assert page.is_file(), f"docs/{name} was not built"
    reference = (site / "config" / "index.html").read_text(encoding="utf-8")
    for field in dataclasses.fields(MoEConfig):
        assert f"<code>{field.name}</code>" in reference, field.name
    api = (site / "api" / "index.html").read_text(encoding="utf-8")
    for name in ("moe_plugin.MoELayer", "moe_plugin.MoEConfig", "moe_plugin.aux_loss",
                 "moe_plugin.integrations.deepspeed.initialize", "moe_plugin.integrations.transformers.swap_moe_blocks"):
        assert f'id="{name}"' in api, f"the API page has no entry for {name}"


@pytest.mark.spawns
def test_docs_hf_page_lists_every_family_of_the_table(site):
    transformers_moe = pytest.importorskip("moe_plugin.integrations.transformers")
    page = (site / "huggingface" / "index.html").read_text(encoding="utf-8")
    for model_type in transformers_moe.FAMILIES:
        assert f"<code>{model_type}</code>" in page, model_type


def test_docs_config_reference_describes_every_field():
    """Every MoEConfig field has words in MoEConfig's docstring: a field added without them fails here."""
    from moe_plugin.config import MoEConfig

    described = _hooks().field_docs(MoEConfig)
    missing = [f.name for f in dataclasses.fields(MoEConfig) if not described.get(f.name)]
    assert not missing, f"MoEConfig's docstring says nothing of {missing}: add an entry 'name: meaning'"
    shared = [name for name, words in described.items() if list(described.values()).count(words) > 1]
    assert not shared, f"MoEConfig's docstring gives {shared} one entry: give each field its own"
    table = _hooks().moe_config_markdown()
    assert "| `capacity_factor` | float | `1.0` | capacity_factor > 0: fixed capacity" in table


def test_docs_generated_markers_are_known():
    hooks = _hooks()
    for name in PAGES:
        for marker in hooks.MARKER.findall((DOCS / name).read_text(encoding="utf-8")):
            assert marker in hooks.GENERATORS, f"docs/{name}: unknown generated block {marker!r}"


def test_docs_have_runnable_examples_on_the_main_pages():
    pages = {block_id.rsplit("-", 1)[0] for block_id, *_ in runnable_blocks()}
    for page in ("index", "layer", "training", "checkpoints", "expert-parallelism", "deepspeed", "huggingface",
                 "fsdp2", "fairseq", "kernels", "benchmarks"):
        assert page in pages, f"docs/{page}.md has no block marked <!-- runnable -->"


@pytest.mark.spawns
@pytest.mark.parametrize("block_id,language,code,expected", runnable_blocks(), ids=[b[0] for b in runnable_blocks()])
def test_docs_example_runs(block_id, language, code, expected, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", REPO=str(REPO), MPLBACKEND="Agg",   # this Python's commands first
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    script = tmp_path / ("example.py" if language == "python" else "example.sh")
    script.write_text(code, encoding="utf-8")   # a file, so that spawned workers can import its functions
    command = [sys.executable, script.name] if language == "python" else ["bash", "-euo", "pipefail", script.name]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (f"docs example {block_id} ({language}) failed with {done.returncode}:\n{code}\n"
                                  f"--- stdout\n{done.stdout[-4000:]}\n--- stderr\n{done.stderr[-4000:]}")
    missing = [text for text in expected if text not in done.stdout + done.stderr]
    assert not missing, f"docs example {block_id}: its output lacks {missing}:\n{done.stdout[-4000:]}"


def _dom(page: Path, *flags: str) -> str:
    done = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                           "--virtual-time-budget=5000", *flags, "--dump-dom", page.as_uri()],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"chromium failed on {page}:\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.mark.spawns
@pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (Debian: apt-get install chromium)")
def test_docs_pages_render_with_navigation_in_chromium(site):
    """The front page and the DeepSpeed page as a browser renders them: the theme's navigation lists every
    section, the page's own title is there, and the search box was built by the theme's script."""
    for page, title in ((site / "index.html", "moe_plugin"), (site / "deepspeed" / "index.html", "DeepSpeed")):
        dom = _dom(page)
        links = re.findall(r'<a [^>]*class="md-nav__link[^"]*"[^>]*>(.*?)</a>', dom, re.S)
        labels = {" ".join(re.sub(r"<[^>]+>", " ", link).split()) for link in links}
        for entry in ("The layer", "Training command", "DeepSpeed", "Hugging Face", "FSDP2", "fairseq",
                      "Troubleshooting", "API"):
            assert entry in labels, f"{page}: the navigation has no link '{entry}' (it has {sorted(labels)})"
        assert re.search(rf"<h1[^>]*>\s*{re.escape(title)}", dom), f"{page}: no title '{title}'"
        assert "md-search__input" in dom, f"{page}: the theme's search box is missing"


# runs in the page once it has loaded: the names in tables' first columns that the layout put on more than one
# line (an inline element wrapped or broken mid-word has several client rectangles), written into the DOM
MEASURE_NAMES = """<script>window.addEventListener("load", () => setTimeout(() => {
  const names = [...document.querySelectorAll("article table tbody tr td:first-child code")];
  const broken = names.filter(code => code.getClientRects().length > 1).map(code => code.textContent);
  document.body.setAttribute("data-measured", names.length + " " + broken.join(" "));
}, 0));</script>"""


@pytest.mark.spawns
@pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (Debian: apt-get install chromium)")
@pytest.mark.parametrize("width", [1280, 800])
def test_docs_config_reference_in_chromium_keeps_names_whole_and_each_meaning_its_own(site, width):
    """The MoEConfig reference as a browser lays it out, on a laptop's and a narrow window's width: no field name
    is broken over lines ("hidden_siz / e"), and every field has a meaning of its own (top_k's repeated
    num_experts')."""
    from moe_plugin.config import MoEConfig

    page = site / "config" / "index.html"
    measured = page.with_name("measured.html")    # beside the page, so that its styles and scripts load alike
    measured.write_text(page.read_text(encoding="utf-8").replace("</body>", MEASURE_NAMES + "</body>"),
                        encoding="utf-8")
    dom = _dom(measured, f"--window-size={width},900")
    count, *broken = re.search(r'data-measured="([^"]*)"', dom).group(1).split(" ")
    fields = [field.name for field in dataclasses.fields(MoEConfig)]
    assert int(count) == len(fields) and not [name for name in broken if name], f"names broken over lines: {broken}"
    rows = re.findall(r"<tr>\s*<td><code>(\w+)</code></td>(?:\s*<td>.*?</td>){2}\s*<td>(.*?)</td>\s*</tr>", dom, re.S)
    meanings = {name: " ".join(re.sub(r"<[^>]+>", " ", cell).split()) for name, cell in rows}
    assert list(meanings) == fields
    shared = {meaning for meaning in meanings.values() if list(meanings.values()).count(meaning) > 1}
    assert all(meanings.values()) and not shared, f"fields without a meaning of their own: {shared}"
    assert meanings["top_k"].startswith("K, how many experts each token goes to"), meanings["top_k"]


def _github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading: lower case, punctuation but - and _ dropped, spaces to -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_docs_readme_and_results_links_resolve():
    """Every relative link in README.md and benchmarks/RESULTS.md names a file or folder of the repository, and a
    link to a section (RESULTS.md#...) names a heading there, so the README's headline table keeps its sources."""
    for source in (REPO / "README.md", REPO / "benchmarks" / "RESULTS.md"):
        for target in re.findall(r"\]\((?!https?:)([^)\s]+)\)", source.read_text(encoding="utf-8")):
            path, _, anchor = target.partition("#")
            file = (source.parent / path) if path else source
            assert file.exists(), f"{source.name} links to {target}, which does not exist"
            if anchor:
                headings = re.findall(r"(?m)^#+ (.+)$", file.read_text(encoding="utf-8"))
                assert anchor in {_github_anchor(h) for h in headings}, f"{source.name}: no heading for #{anchor}"
