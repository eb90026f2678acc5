"""The documentation runs as written.

Docstrings: every public function has a NumPy-style docstring with shapes and an Examples section, and the
examples run (the GPU lines are marked ``+SKIP``; the rest use NumPy inputs, the CPU path).

Markdown: every ```python block of README.md and docs/*.md (not docs/design/) runs, in order, one namespace
per file. An unmarked block must run with NumPy alone (CuPy hidden). A block whose fence follows the line
``<!-- test: gpu -->`` runs only in the file's GPU run (marked ``gpu``: skipped without a GPU), which runs
every block of the file in order; ``<!-- test: gpu torch -->`` also needs torch importable and
``<!-- test: gpu jax -->`` jax (otherwise that block is left out). A failure names the file and the line of
the block, and its traceback points into the Markdown file. docs/design/ holds no runnable blocks.

Version pointers: no file of the package, the kernels, the tests or the docs points at a notebook version
or an issue number (what those say belongs in the text itself).
"""

import doctest
import importlib.util
import inspect
import re
import sys
import typing
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers.gpu import gpu_available

import cupyflash
from cupyflash import distributed, reference

ROOT = Path(__file__).resolve().parents[2]
PUBLIC = {
    "attention": cupyflash.attention,
    "attention_forward": cupyflash.attention_forward,
    "attention_backward": cupyflash.attention_backward,
    "attention_probs": cupyflash.attention_probs,
    "attention_varlen": cupyflash.attention_varlen,
    "attention_varlen_forward": cupyflash.attention_varlen_forward,
    "attention_varlen_backward": cupyflash.attention_varlen_backward,
    "attention_with_kvcache": cupyflash.attention_with_kvcache,
    "merge_attention_states": cupyflash.merge_attention_states,
    "merge_attention_states_stacked": cupyflash.merge_attention_states_stacked,
    "block_mask_from_dense": cupyflash.block_mask_from_dense,
    "quantize_fp8": cupyflash.quantize_fp8,
    "quantize_kvcache": cupyflash.quantize_kvcache,
    "hadamard_rotate": cupyflash.hadamard_rotate,
    "warmup": cupyflash.warmup,
    "reference.attention": reference.attention,
    "reference.attention_backward": reference.attention_backward,
    "reference.attention_probs": reference.attention_probs,
    "reference.attention_with_kvcache": reference.attention_with_kvcache,
    "reference.rotary": reference.rotary,
    "reference.attention_varlen": reference.attention_varlen,
    "reference.attention_varlen_backward": reference.attention_varlen_backward,
    "reference.dropout_mask": reference.dropout_mask,
    "distributed.init": distributed.init,
    "distributed.shard": distributed.shard,
    "distributed.unshard": distributed.unshard,
    "distributed.ring_attention": distributed.ring_attention,
    "distributed.ring_attention_forward": distributed.ring_attention_forward,
    "distributed.ring_attention_backward": distributed.ring_attention_backward,
    "distributed.shard_varlen": distributed.shard_varlen,
    "distributed.unshard_varlen": distributed.unshard_varlen,
    "distributed.ring_attention_varlen": distributed.ring_attention_varlen,
    "distributed.ring_attention_varlen_forward": distributed.ring_attention_varlen_forward,
    "distributed.ring_attention_varlen_backward": distributed.ring_attention_varlen_backward,
}
CLASSES = {"distributed.InProcessGroup": distributed.InProcessGroup, "FP8KVCache": cupyflash.FP8KVCache}
TAKES_NO_ARRAYS = {"distributed.init"}
SECTIONS = ("Parameters\n    ----------", "Returns\n    -------", "Examples\n    --------")


# ------------------------------------------------------------------------------------------ docstrings
def test_the_public_list_is_complete():
    exported = {name for name in cupyflash.__all__ if inspect.isfunction(getattr(cupyflash, name))}
    assert exported == {name for name in PUBLIC if "." not in name}


@pytest.mark.parametrize("name", PUBLIC)
def test_docstring_has_the_numpydoc_sections(name):
    doc = PUBLIC[name].__doc__ or ""
    missing = [s.split("\n")[0] for s in SECTIONS if s not in doc]
    assert not missing, f"{name}'s docstring lacks {missing}"
    if name not in TAKES_NO_ARRAYS:
        assert "shape" in doc, f"{name}'s docstring gives no shapes"


@pytest.mark.parametrize("name", PUBLIC)
def test_signature_is_fully_annotated(name):
    function = PUBLIC[name]
    signature = inspect.signature(function)
    bare = [p for p in signature.parameters if signature.parameters[p].annotation is inspect.Parameter.empty]
    assert not bare, f"{name}: parameters without a type hint: {bare}"
    assert signature.return_annotation is not inspect.Signature.empty, f"{name} has no return type hint"
    if sys.version_info >= (3, 10):  # "X | None" in string annotations evaluates from 3.10 on
        typing.get_type_hints(function)  # the hints resolve: every name in them exists


@pytest.mark.parametrize("name", PUBLIC)
def test_examples_run(name):
    function = PUBLIC[name]
    (test,) = doctest.DocTestFinder(recurse=False).find(function, name, globs={})
    assert test.examples, f"{name} has no examples"
    report = []
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    runner.run(test, out=report.append)
    assert runner.failures == 0, "".join(report)


@pytest.mark.parametrize("name", CLASSES)
def test_class_docstrings_and_examples(name):
    cls = CLASSES[name]
    missing = [s.split("\n")[0] for s in SECTIONS if s not in (cls.__doc__ or "")]
    assert not missing, f"{name}'s docstring lacks {missing}"
    (test,) = doctest.DocTestFinder(recurse=False).find(cls, name, globs={})
    report = []
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    runner.run(test, out=report.append)
    assert test.examples and runner.failures == 0, "".join(report)


def test_the_distributed_public_list_is_complete():
    exported = {name for name in distributed.__all__ if inspect.isfunction(getattr(distributed, name))}
    assert exported == {name.split(".", 1)[1] for name in PUBLIC if name.startswith("distributed.")}
    assert {name for name in distributed.__all__ if inspect.isclass(getattr(distributed, name))} - {"Communicator"} == {
        name.split(".", 1)[1] for name in CLASSES if name.startswith("distributed.")
    }


# ------------------------------------------------------------------------------------------ Markdown
_FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
_MARKER = re.compile(r"^<!--\s*test:\s*(.*?)\s*-->$")
MARKERS = {"gpu": frozenset({"gpu"}), "gpu torch": frozenset({"gpu", "torch"}), "gpu jax": frozenset({"gpu", "jax"})}


@dataclass(frozen=True)
class Block:
    line: int  # 1-based line of the block's first line of code (the one after the fence)
    code: str
    needs: frozenset  # {} (NumPy alone), or "gpu" and maybe "torch" or "jax"


def markdown_files():
    """README.md and docs/*.md, relative to the repository (docs/design/ apart: it has no runnable blocks)."""
    return ["README.md"] + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))


def python_blocks(text, where="the text"):
    """The ```python blocks of a Markdown text, in order, with the requirements their marker line gives."""
    lines = text.splitlines()
    blocks, fence, start, language, marker = [], None, 0, "", None
    for number, line in enumerate(lines, 1):
        match = _FENCE.match(line)
        if fence is None:
            if match:
                fence, start, language = match.group(1), number, match.group(2)
                previous = lines[number - 2].strip() if number > 1 else ""
                marked = _MARKER.match(previous)
                marker = marked.group(1) if marked else None
                if marker is not None:
                    assert marker in MARKERS, f"{where}:{number - 1}: unknown marker <!-- test: {marker} -->"
                    assert language == "python", f"{where}:{number - 1}: a test marker before a ```{language} block"
            elif _MARKER.match(line.strip()):
                following = lines[number].strip() if number < len(lines) else ""
                assert following.startswith("```"), f"{where}:{number}: a test marker not right before a fence"
        elif match and not match.group(2):
            if language == "python":
                body = [code[len(fence) :] if code.startswith(fence) else code for code in lines[start : number - 1]]
                blocks.append(Block(start + 1, "\n".join(body) + "\n", MARKERS.get(marker, frozenset())))
            fence = None
    assert fence is None, f"{where}:{start}: a fence that never closes"
    return blocks


def _cases():
    cases = []
    for name in markdown_files():
        blocks = python_blocks((ROOT / name).read_text(), name)
        if any(not block.needs for block in blocks):
            cases.append(pytest.param(name, "cpu", id=f"{name}-cpu"))
        if any(block.needs for block in blocks):
            cases.append(pytest.param(name, "gpu", id=f"{name}-gpu", marks=pytest.mark.gpu))
    return cases


def _available(module):
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _run_blocks(name, blocks):
    """Each block in order in one namespace; the code keeps its Markdown line numbers for tracebacks."""
    namespace = {"__name__": f"docs:{name}"}
    for block in blocks:
        code = compile("\n" * (block.line - 1) + block.code, str(ROOT / name), "exec")
        try:
            exec(code, namespace)
        except Exception as error:
            raise AssertionError(
                f"{name}: the python block at line {block.line} raised {type(error).__name__}: {error}"
            ) from error


@pytest.mark.parametrize("name, kind", _cases())
def test_markdown_python_blocks_run(name, kind, monkeypatch, tmp_path):
    blocks = python_blocks((ROOT / name).read_text(), name)
    monkeypatch.chdir(tmp_path)  # anything a block writes lands here
    if kind == "cpu":
        monkeypatch.setitem(sys.modules, "cupy", None)  # NumPy alone: `import cupy` raises ImportError
        _run_blocks(name, [block for block in blocks if not block.needs])
        return
    assert gpu_available(), "the gpu marker's hook skips this without a GPU"
    # JAX takes most of the GPU's memory when it starts unless told not to (docs/interop.md says so too).
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    missing = {need for block in blocks for need in block.needs - {"gpu"} if not _available(need)}
    runnable = [block for block in blocks if not block.needs & missing]
    if not any(block.needs for block in runnable):
        pytest.skip(f"{name}: its GPU blocks need {sorted(missing)}")
    _run_blocks(name, runnable)


def test_the_markdown_parser():
    text = "\n".join(
        [
            "# Title",
            "",
            "```python",
            "a = 1",
            "```",
            "",
            "<!-- test: gpu -->",
            "```python",
            "b = a + 1",
            "```",
            "```bash",
            "echo ```python",
            "```",
            "- item:",
            "",
            "  <!-- test: gpu torch -->",
            "  ```python",
            "  import torch",
            "  ```",
            "```text",
            "not code",
            "```",
        ]
    )
    blocks = python_blocks(text)
    assert [(b.line, b.code, b.needs) for b in blocks] == [
        (4, "a = 1\n", frozenset()),
        (9, "b = a + 1\n", frozenset({"gpu"})),
        (18, "import torch\n", frozenset({"gpu", "torch"})),
    ]
    with pytest.raises(AssertionError, match="unknown marker"):
        python_blocks("<!-- test: gpu pytorch -->\n```python\nx = 1\n```")
    with pytest.raises(AssertionError, match="not right before a fence"):
        python_blocks("<!-- test: gpu -->\n\n```python\nx = 1\n```")
    with pytest.raises(AssertionError, match="never closes"):
        python_blocks("```python\nx = 1\n")


def test_every_markdown_file_is_found_and_has_blocks():
    names = markdown_files()
    assert "README.md" in names and "docs/api.md" in names and not any("design" in n for n in names)
    assert sum(len(python_blocks((ROOT / n).read_text(), n)) for n in names) > 0


def test_design_docs_have_no_python_blocks():
    """docs/design/ explains; its code is sketches (```text) or commands (```bash), never run."""
    found = {}
    for path in sorted((ROOT / "docs" / "design").glob("*.md")):
        blocks = python_blocks(path.read_text(), str(path.relative_to(ROOT)))
        if blocks:
            found[str(path.relative_to(ROOT))] = [block.line for block in blocks]
    assert not found, f"```python blocks in docs/design/ (file: lines): {found}"


# ------------------------------------------------------------------------------------------ version pointers
VERSION_POINTER = re.compile(r"\(v\d{1,2}\)|NOTES\.md[^a-z]{0,4}v\d|\b(?i:issue) \d+")
SCANNED = ("cupyflash", "cuda_src", "tests", "docs", "README.md")
SKIPPED_PARTS = {"__pycache__", ".pytest_cache"}


def _text_files():
    for top in SCANNED:
        path = ROOT / top
        for file in [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()):
            if SKIPPED_PARTS & set(file.parts) or file.suffix in (".pyc", ".so", ".png", ".whl"):
                continue
            try:
                yield file, file.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                continue


def test_no_version_pointers():
    found = []
    for file, text in _text_files():
        for number, line in enumerate(text.splitlines(), 1):
            for match in VERSION_POINTER.finditer(line):
                found.append(f"{file.relative_to(ROOT)}:{number}: {match.group(0)!r}")
    assert not found, "pointers at notebook versions or issue numbers:\n" + "\n".join(found)


def test_the_version_pointer_pattern():
    # (the pointers are put together here, so that this file holds none of them)
    pointers = [
        ("measured (v", "18) there"),
        ("bench/log/NOTES.md, v", "26"),
        ("NOTES.md v", "3"),
        ("see issue ", "12"),
        ("Issue ", "4"),
    ]
    for text in ("".join(parts) for parts in pointers):
        assert VERSION_POINTER.search(text), text
    # (a word that ends in "issue" before a number, put together likewise: a simpler pattern would flag it)
    for text in ("version 2", "NOTES.md describes", "an issue with 3 heads", "t" + "issue " + "3", "(v)", "dev2"):
        assert not VERSION_POINTER.search(text), text
