"""Every public function has a NumPy-style docstring with shapes and an Examples section, and the
examples run as written (the GPU lines are marked ``+SKIP``; the rest use NumPy inputs, the CPU path)."""

import doctest
import inspect
import sys
import typing

import pytest

import cupyflash
from cupyflash import reference

PUBLIC = {
    "attention": cupyflash.attention,
    "attention_forward": cupyflash.attention_forward,
    "attention_backward": cupyflash.attention_backward,
    "attention_probs": cupyflash.attention_probs,
    "attention_varlen": cupyflash.attention_varlen,
    "attention_varlen_forward": cupyflash.attention_varlen_forward,
    "attention_varlen_backward": cupyflash.attention_varlen_backward,
    "block_mask_from_dense": cupyflash.block_mask_from_dense,
    "warmup": cupyflash.warmup,
    "reference.attention": reference.attention,
    "reference.attention_backward": reference.attention_backward,
    "reference.attention_probs": reference.attention_probs,
    "reference.attention_varlen": reference.attention_varlen,
    "reference.attention_varlen_backward": reference.attention_varlen_backward,
    "reference.dropout_mask": reference.dropout_mask,
}
SECTIONS = ("Parameters\n    ----------", "Returns\n    -------", "Examples\n    --------")


def test_the_public_list_is_complete():
    exported = {name for name in cupyflash.__all__ if inspect.isfunction(getattr(cupyflash, name))}
    assert exported == {name for name in PUBLIC if "." not in name}


@pytest.mark.parametrize("name", PUBLIC)
def test_docstring_has_the_numpydoc_sections(name):
    doc = PUBLIC[name].__doc__ or ""
    missing = [s.split("\n")[0] for s in SECTIONS if s not in doc]
    assert not missing, f"{name}'s docstring lacks {missing}"
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
