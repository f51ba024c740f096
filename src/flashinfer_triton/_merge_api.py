"""The public state-merge functions (re-exported by :mod:`flashinfer_triton.cascade`).

An attention state is ``(v, s)``: the softmax-weighted values over a set of keys and the base-2
log-sum-exp of the scores. States over disjoint key sets merge exactly:
``s = log2(2**s_a + 2**s_b)``, ``v = (2**s_a * v_a + 2**s_b * v_b) / 2**s``; the operation is
associative and commutative, and an empty state (``s = -inf``) is its identity.
"""

from __future__ import annotations

import torch

from . import _checks as C
from . import _custom_ops, reference
from ._backend import kernels_for
from ._launch import hooks_set

_V_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _merge_impl(device):
    """The Triton merge kernels for ``device``, or None for the PyTorch path (``_backend.kernels_for``)."""
    return kernels_for("merge", device)


def _check_state(v_name, v, s_name, s, *, device=None):
    """Tensors, dtypes, shapes, devices and a contiguous last dim, each error naming the argument."""
    C.check_tensor(v_name, v, dtypes=_V_DTYPES, device=device)
    C.check_tensor(s_name, s, dtypes=(torch.float32,), device=v.device)
    if v.dim() < 2 or s.shape != v.shape[:-1]:
        raise C.value_error(s_name, f"shape {v_name}.shape[:-1] = {C.shape_str(v.shape[:-1])}", C.shape_str(s.shape))
    C.check_last_dim_contiguous(v_name, v)


# merge_state's checks and launch depend only on the forms of its four tensors (shape, dtype, device, and whether
# each is contiguous: only contiguous states bind, and a contiguous tensor's rows are one stride apart whatever
# its size-1 dimensions' strides): a form that passed them keeps its launch bound (``_launch.bind``), and later
# calls of it launch directly.
_MERGE_BOUND: dict = {}
_T = torch.Tensor
_CONTIGUOUS = torch.contiguous_format
_empty_like = torch.empty_like


def _forms(v_a, s_a, v_b, s_b) -> tuple | None:
    """The key of merge_state's four tensors (one flat tuple: no tuple per tensor), None for a non-tensor."""
    if type(v_a) is not _T or type(s_a) is not _T or type(v_b) is not _T or type(s_b) is not _T:
        return None
    return (v_a.shape, v_a.dtype, v_a.device, v_a.is_contiguous(), s_a.shape, s_a.dtype, s_a.device,
            s_a.is_contiguous(), v_b.shape, v_b.dtype, v_b.device, v_b.is_contiguous(), s_b.shape, s_b.dtype,
            s_b.device, s_b.is_contiguous())  # fmt: skip


def keep_bound_launch(v_a, s_a, v_b, s_b, launch) -> None:
    """Keep ``launch`` (called with the seven addresses v_a, s_a, v_b, s_b, out v, out s, s_a; it returns False
    where it did not launch) as the bound launch of these four tensors' form: later ``merge_state`` calls of the
    form go straight to it, without checks. ``merge_state`` keeps the launch it bound after the first checked call
    of a form; ``host_caches()["merge_state"]`` lists the forms kept."""
    form = _forms(v_a, s_a, v_b, s_b)
    if form is None:
        raise TypeError("v_a, s_a, v_b, s_b: expected four torch.Tensor")
    if len(_MERGE_BOUND) >= 64:
        _MERGE_BOUND.clear()
    _MERGE_BOUND[form] = launch


# merge_states's checks and launch depend only on the shapes, strides, dtypes and device of v and s: a form that
# passed them keeps its launch bound, as merge_state's forms do.
_STATES_BOUND: dict = {}


def _states_form(v, s) -> tuple | None:
    """The key of merge_states's two tensors, None for a non-tensor."""
    if type(v) is not _T or type(s) is not _T:
        return None
    return (v.shape, v.stride(), v.dtype, v.device, s.shape, s.stride(), s.dtype, s.device)


def merge_state(v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor):
    """Merge two attention states over disjoint key sets.

    Parameters
    ----------
    v_a, v_b : ``[seq_len, num_heads, head_dim]``, float16/bfloat16/float32.
    s_a, s_b : ``[seq_len, num_heads]``, float32, base-2 log-sum-exp.

    Returns
    -------
    ``(v, s)``: v in the dtype of ``v_a``, s float32. A side with ``s = -inf`` leaves the other unchanged.

    Examples
    --------
    >>> import torch, flashinfer_triton as fi
    >>> v = torch.randn(4, 2, 8); s = torch.randn(4, 2)
    >>> vm, sm = fi.merge_state(v, s, v, s)
    >>> bool(torch.allclose(vm, v, atol=1e-6)) and bool(torch.allclose(sm, s + 1))
    True
    """
    if torch.compiler.is_compiling():  # the custom op: Dynamo does not trace the launch path
        return _custom_ops.merge_state(v_a, s_a, v_b, s_b)
    if type(v_a) is _T and type(s_a) is _T and type(v_b) is _T and type(s_b) is _T:
        # _forms' key, written out here (no call per lookup): with its lookup a quarter of a bound call's host time
        form = (v_a.shape, v_a.dtype, v_a.device, v_a.is_contiguous(), s_a.shape, s_a.dtype, s_a.device,
                s_a.is_contiguous(), v_b.shape, v_b.dtype, v_b.device, v_b.is_contiguous(), s_b.shape, s_b.dtype,
                s_b.device, s_b.is_contiguous())  # fmt: skip
        bound = _MERGE_BOUND.get(form)
        if bound is not None:  # a form whose checks passed and whose launch was bound
            # (empty_like: no argument parsing of a shape, dtype and device, a third of torch.empty's host time;
            # the bound form's s_a is float32 and contiguous like the outputs)
            out_v = _empty_like(v_a, memory_format=_CONTIGUOUS)
            out_s = _empty_like(s_a, memory_format=_CONTIGUOUS)
            pa, pb, ps_a = v_a.data_ptr(), v_b.data_ptr(), s_a.data_ptr()
            ov, os_, ps_b = out_v.data_ptr(), out_s.data_ptr(), s_b.data_ptr()
            if (
                not (pa | pb | ps_a | ps_b | ov | os_) & 15
                and not hooks_set()
                and bound(pa, ps_a, pb, ps_b, ov, os_, ps_a)
            ):
                return out_v, out_s
    else:
        form = None
    _check_state("v_a", v_a, "s_a", s_a)
    _check_state("v_b", v_b, "s_b", s_b, device=v_a.device)
    if v_b.shape != v_a.shape:
        raise C.value_error("v_b", f"the shape of v_a {C.shape_str(v_a.shape)}", C.shape_str(v_b.shape))
    if v_b.dtype != v_a.dtype:
        raise C.type_error("v_b", f"the dtype of v_a ({v_a.dtype})", str(v_b.dtype))
    impl = _merge_impl(v_a.device)
    if impl is not None:
        if form is None:
            return impl.merge_state(v_a, s_a, v_b, s_b)
        got = []
        out = impl.merge_state(v_a, s_a, v_b, s_b, bind=got)
        if got:
            keep_bound_launch(v_a, s_a, v_b, s_b, got[0])
        return out
    v, s = reference.merge_state(v_a, s_a, v_b, s_b)
    return v.to(v_a.dtype), s


def merge_state_in_place(
    v: torch.Tensor, s: torch.Tensor, v_other: torch.Tensor, s_other: torch.Tensor, mask: torch.Tensor | None = None
) -> None:
    """``(v, s) <- merge((v, s), (v_other, s_other))`` in place; rows ``i`` with ``mask[i] == False`` are left
    untouched. Shapes as in :func:`merge_state`; ``mask`` is bool ``[seq_len]`` on the same device."""
    if torch.compiler.is_compiling():  # the custom op: Dynamo does not trace the launch path
        return _custom_ops.merge_state_in_place(v, s, v_other, s_other, mask)
    _check_state("v", v, "s", s)
    _check_state("v_other", v_other, "s_other", s_other, device=v.device)
    if v_other.shape != v.shape:
        raise C.value_error("v_other", f"the shape of v {C.shape_str(v.shape)}", C.shape_str(v_other.shape))
    if v_other.dtype != v.dtype:
        raise C.type_error("v_other", f"the dtype of v ({v.dtype})", str(v_other.dtype))
    if mask is not None:
        C.check_tensor("mask", mask, dim=1, dtypes=(torch.bool,), device=v.device)
        if mask.shape[0] != v.shape[0]:
            raise C.value_error("mask", f"shape [seq_len] = [{v.shape[0]}]", C.shape_str(mask.shape))
    impl = _merge_impl(v.device)
    if impl is not None:
        impl.merge_state_in_place(v, s, v_other, s_other, mask)
        return
    reference.merge_state_in_place(v, s, v_other, s_other, mask)


def merge_states(v: torch.Tensor, s: torch.Tensor):
    """Merge ``num_states`` states per row: ``v [seq_len, num_states, num_heads, head_dim]`` and
    ``s [seq_len, num_states, num_heads]`` (float32, base 2) -> ``v [seq_len, num_heads, head_dim]``
    (dtype of v) and ``s [seq_len, num_heads]`` float32."""
    if torch.compiler.is_compiling():  # the custom op: Dynamo does not trace the launch path
        return _custom_ops.merge_states(v, s)
    form = _states_form(v, s)
    bound = _STATES_BOUND.get(form) if form is not None else None
    if bound is not None:  # a form whose checks passed and whose launch was bound
        launch, out_v_shape, out_s_shape = bound
        out_v = v.new_empty(out_v_shape)
        out_s = s.new_empty(out_s_shape)
        pv, ps, ov, os_ = v.data_ptr(), s.data_ptr(), out_v.data_ptr(), out_s.data_ptr()
        if not (pv | ps | ov | os_) & 15 and not hooks_set() and launch(pv, ps, ov, os_):
            return out_v, out_s
    C.check_tensor("v", v, dim=4, dtypes=_V_DTYPES)
    C.check_tensor("s", s, dim=3, dtypes=(torch.float32,), device=v.device)
    if tuple(s.shape) != tuple(v.shape[:3]):
        raise C.value_error("s", f"shape v.shape[:3] = {C.shape_str(v.shape[:3])}", C.shape_str(s.shape))
    C.check_last_dim_contiguous("v", v)
    impl = _merge_impl(v.device)
    if impl is not None:
        if form is None:
            return impl.merge_states(v, s)
        got = []
        out = impl.merge_states(v, s, bind=got)
        if got:
            if len(_STATES_BOUND) >= 64:
                _STATES_BOUND.clear()
            _STATES_BOUND[form] = (got[0], out[0].shape, out[1].shape)
        return out
    vo, so = reference.merge_states(v, s)
    return vo.to(v.dtype), so
