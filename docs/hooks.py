"""MkDocs hook: pages generated from the code at build time, so they cannot drift from it.

A page holds a marker comment; on_page_markdown replaces it:
    <!-- generated: moe-config -->    MoEConfig's fields: name, type, default, and the docstring's words on it
    <!-- generated: hf-families -->   the Hugging Face families of the table (families.supported_model_types_markdown)
    <!-- generated: fairseq-readme --> integrations/fairseq_moe/README.md (the package's notes), its headings one level down
    <!-- generated: results -->        benchmarks/RESULTS.md, its headings one level down
"""
import dataclasses
import re
import typing
from pathlib import Path

MARKER = re.compile(r"<!-- generated: ([a-z-]+) -->")


def field_docs(cls) -> dict:
    """{field: its description} from a dataclass docstring's entries: an entry is a line at the docstring's
    indent that starts with one or more field names ("a / b ..." or "a > 0: ..."), its continuation lines are
    indented further. Fields an entry names share its text."""
    lines = (cls.__doc__ or "").splitlines()
    names = [f.name for f in dataclasses.fields(cls)]
    entries, current = [], None
    for line in lines[1:]:
        if not line.strip():
            current = None
            continue
        indent = len(line) - len(line.lstrip())
        head = line.strip()
        leading = re.match(r"([a-z_0-9]+(?:\s*/\s*[a-z_0-9]+)*)", head)
        if indent == 4 and leading and any(n in names for n in re.split(r"\s*/\s*", leading.group(1))):
            current = [re.split(r"\s*/\s*", leading.group(1)), [head]]
            entries.append(current)
        elif current is not None and indent > 4:
            current[1].append(head)
        else:
            current = None
    docs = {}
    for fields, text in entries:
        text[0] = re.sub(r"^[a-z_0-9]+(\s*/\s*[a-z_0-9]+)*:\s*", "", text[0])   # the names the table shows
        for name in fields:
            if name in names:
                docs[name] = (docs.get(name, "") + " " + " ".join(text)).strip()
    return docs


def _type_name(tp) -> str:
    if isinstance(tp, str):
        return tp
    if typing.get_origin(tp) is typing.Union:
        return " | ".join("None" if a is type(None) else getattr(a, "__name__", str(a)) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def moe_config_markdown() -> str:
    from moe_plugin.config import MoEConfig

    docs = field_docs(MoEConfig)
    hints = typing.get_type_hints(MoEConfig)
    rows = ["| field | type | default | meaning |", "|---|---|---|---|"]
    for f in dataclasses.fields(MoEConfig):
        default = "required" if f.default is dataclasses.MISSING else f"`{f.default!r}`"
        rows.append(f"| `{f.name}` | {_cell(_type_name(hints[f.name]))} | {_cell(default)} | "
                    f"{_cell(docs.get(f.name, ''))} |")
    return "\n".join(rows) + "\n"


def hf_families_markdown() -> str:
    from moe_plugin.integrations.transformers.families import supported_model_types_markdown

    return supported_model_types_markdown()


REPO = Path(__file__).resolve().parents[1]


def included(path: str, levels: int) -> str:
    """A repository file without its title, its headings `levels` down, and its links to repository files (which
    the site does not hold) as plain code."""
    text = (REPO / path).read_text(encoding="utf-8")
    lines, fence = [], False
    for line in text.splitlines()[1:]:
        fence ^= line.startswith("```")
        lines.append("#" * levels + line if line.startswith("#") and not fence else line)
    text = "\n".join(_blank_line_before_lists(lines)) + "\n"
    return re.sub(r"\[([^\]]+)\]\((?!https?:|#)([^)]+)\)", lambda m: f"{m.group(1)} (`{m.group(2)}`)", text)


def _blank_line_before_lists(lines: list) -> list:
    """GitHub starts a list right after a paragraph line; Python-Markdown needs a blank line there."""
    out, fence = [], False
    for line in lines:
        fence ^= line.startswith("```")
        if not fence and re.match(r"[-*] ", line) and out and out[-1].strip() and not out[-1].startswith((" ", "-", "*", "|")):
            out.append("")
        out.append(line)
    return out


def fairseq_readme_markdown() -> str:
    return included("integrations/fairseq_moe/README.md", 1)


def results_markdown() -> str:
    return included("benchmarks/RESULTS.md", 1)


GENERATORS = {"moe-config": moe_config_markdown, "hf-families": hf_families_markdown,
              "fairseq-readme": fairseq_readme_markdown, "results": results_markdown}


def on_page_markdown(markdown, page, config, files):
    def replace(match):
        name = match.group(1)
        if name not in GENERATORS:
            raise ValueError(f"{page.file.src_path}: unknown generated block {name!r}; known: {sorted(GENERATORS)}")
        return GENERATORS[name]()
    return MARKER.sub(replace, markdown)
