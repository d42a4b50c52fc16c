"""The backend switch (kivi_kernels.get_ops): every op's PyTorch reference takes the Triton launcher's arguments in the
same order, so one switch can swap them for a whole model; bad backends and op names are clear errors."""

import inspect

import pytest

import kivi_kernels


@pytest.mark.parametrize("op", sorted(kivi_kernels._OPS))
def test_reference_takes_the_launchers_arguments(op):
    launcher, reference = getattr(kivi_kernels.get_ops("triton"), op), getattr(kivi_kernels.get_ops("reference"), op)
    assert launcher is not reference
    ours, spec = inspect.signature(launcher).parameters, inspect.signature(reference).parameters
    assert list(spec) == list(ours), f"{op}: reference {list(spec)} against launcher {list(ours)}"
    assert [p.kind for p in spec.values()] == [p.kind for p in ours.values()]


def test_bad_backend_and_op_are_clear_errors():
    with pytest.raises(ValueError, match="backend must be one of"):
        kivi_kernels.get_ops("cuda")
    with pytest.raises(AttributeError, match="no kernel op named 'flash'"):
        kivi_kernels.get_ops("reference").flash  # noqa: B018
