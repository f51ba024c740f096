"""FlashInfer's ``flashinfer.sampling``: softmax, sampling from probabilities or logits with top-k,
top-p and min-p filters, renormalisation, top-k logit masking and chain speculative sampling.

Semantics (FlashInfer 0.7.2): a row keeps ``top_k`` largest probabilities (``top_k <= 0`` or ``>= vocab``:
all; ties with the k-th value are kept), the smallest top set of mass ``>= top_p`` (``top_p >= 1``: all),
or the probabilities ``>= min_p * max``. ``filter_apply_order="top_k_first"`` applies top-p to the
renormalised top-k set, ``"joint"`` keeps the intersection of both sets. Samples are drawn exactly from
the kept set renormalised. ``indices`` maps output row ``i`` to input row ``indices[i]`` (per-row
``top_k``/``top_p``/``min_p`` tensors are per output row) and sets the output dtype (else int32).

Draws: top-p alone by rejection rounds (FlashInfer's method, here with two proposals a round, three from
``SamplingConfig.topp_three_proposals_min_batch`` rows on: each round samples the row restricted above a lower
bound and keeps a proposal iff it is in the kept set, else raises the bound; the exact threshold after
``SamplingConfig.topp_rounds`` rounds); every other sampler through the exact kept set and one uniform per row
through its inverse CDF. Both are exact in distribution (docs/ops.md).

Randomness: one uniform per output row (``topp_rounds * K + 1`` for top-p alone, ``K`` proposals a round by
``SamplingConfig.topp_proposals_at(batch)``; ``n + 1`` per request for chain speculative sampling), drawn with
``torch.rand`` from ``generator`` (the device's default generator when None), which is CUDA-graph safe and
advances the generator; or, when both ``seed`` and ``offset`` are given (ints, or int64 tensors of length 1 or
the batch size), from Philox in a kernel (CPU tensors on the PyTorch path: from a CPU generator seeded per row).
Draws run in a fixed order, so results are deterministic given the uniforms: ``deterministic`` is accepted and
always holds. The PyTorch path runs the kernels' draw rules on the same uniforms, so it gives the kernels' tokens
for the same uniforms (up to float32 rounding at a decision's threshold).

CUDA tensors run ``kernels/sampling.py`` with no host synchronisation (except ``check_nan=True``, which
reads the device as FlashInfer does); CPU tensors a PyTorch path (or the kernels under
``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import enum

import torch

from . import _config
from ._backend import use_triton
from ._checks import check_tensor, shape_str, type_error, value_error
from ._sampling_v02 import GIVEN_UNIFORMS, accepts_v02_uniforms

__all__ = [
    "chain_speculative_sampling",
    "min_p_sampling_from_probs",
    "sampling_from_logits",
    "sampling_from_probs",
    "softmax",
    "top_k_mask_logits",
    "top_k_renorm_probs",
    "top_k_sampling_from_probs",
    "top_k_top_p_sampling_from_logits",
    "top_k_top_p_sampling_from_probs",
    "top_p_renorm_probs",
    "top_p_sampling_from_probs",
]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_IDX = (torch.int32, torch.int64)
_ORDERS = ("top_k_first", "joint")


# ----------------------------------------------------------------------------------------------- checks


def _check_rows(name: str, x) -> torch.Tensor:
    check_tensor(name, x, dim=2, dtypes=_FLOATS)
    if x.shape[1] == 0:
        raise value_error(name, "a vocabulary of at least 1", shape_str(x.shape))
    if x.shape[1] >= 2**31 - 1024:
        raise value_error(name, "a vocabulary below 2**31", x.shape[1])
    return x if x.stride(1) == 1 else x.contiguous()


def _check_bool(name: str, v) -> bool:
    if not isinstance(v, bool):
        raise type_error(name, "a bool", type(v).__name__)
    return v


def _check_indices(indices, x: torch.Tensor) -> int:
    if indices is None:
        return x.shape[0]
    check_tensor("indices", indices, dim=1, dtypes=_IDX, device=x.device)
    return indices.shape[0]


def _param(name: str, v, n: int, device, is_int: bool, lo=None, hi=None):
    """A python scalar, or a per-row tensor of length ``n`` on ``device`` (converted, never synced)."""
    if isinstance(v, torch.Tensor):
        check_tensor(name, v, device=device)
        if v.dim() != 1 or v.shape[0] != n:
            raise value_error(
                name, f"a scalar or a 1-D tensor of shape [{n}] (one value per output row)", shape_str(v.shape)
            )
        if is_int and v.is_floating_point():
            raise type_error(name, "an integer tensor", str(v.dtype).replace("torch.", ""))
        return v.to(torch.int32 if is_int else torch.float32).contiguous()
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (is_int and not isinstance(v, int)):
        raise type_error(name, "an int or a tensor" if is_int else "a float or a tensor", type(v).__name__)
    if not is_int:
        v = float(v)
        if not (lo <= v <= hi):
            raise value_error(name, f"a value in [{lo}, {hi}]", v)
    return v


def _check_nan(x: torch.Tensor, check_nan: bool, what: str) -> None:
    if _check_bool("check_nan", check_nan) and bool(torch.isnan(x).any()):
        raise ValueError(f"Input {what} contains NaN.")


# ----------------------------------------------------------------------------------------------- randomness


def _seed_arg(name: str, v, n: int, device):
    if isinstance(v, torch.Tensor):
        check_tensor(name, v, dim=1, device=device)
        if v.dtype not in (torch.int64, getattr(torch, "uint64", torch.int64)):
            raise type_error(name, "an int64 or uint64 tensor", str(v.dtype).replace("torch.", ""))
        if v.shape[0] not in (1, n):
            raise value_error(name, f"a tensor of shape [1] or [{n}]", shape_str(v.shape))
        return v.view(torch.int64).expand(n).contiguous()
    if isinstance(v, bool) or not isinstance(v, int):
        raise type_error(name, "an int or an int64 tensor", type(v).__name__)
    return v & (2**63 - 1)


def _uniforms(n: int, n_u: int, device, generator, seed, offset) -> torch.Tensor:
    given = GIVEN_UNIFORMS.get()
    if given is not None:  # a FlashInfer 0.2 call's own uniform_samples (_sampling_v02)
        return given
    if seed is None and offset is None:
        if generator is not None and not isinstance(generator, torch.Generator):
            raise type_error("generator", "None or a torch.Generator", type(generator).__name__)
        return torch.rand((n, n_u), device=device, generator=generator)
    if seed is None or offset is None:
        raise ValueError("seed and offset: give both or neither")
    if isinstance(seed, torch.Tensor) != isinstance(offset, torch.Tensor):
        raise ValueError("seed and offset must both be tensors or both be scalars")
    seed = _seed_arg("seed", seed, n, device)
    offset = _seed_arg("offset", offset, n, device)
    u = torch.empty((n, n_u), dtype=torch.float32, device=device)
    if n == 0:
        return u
    if use_triton(device):
        from .kernels.sampling import launch_uniform

        launch_uniform(seed, offset, n, n_u, u)
        return u
    seeds = seed.tolist() if isinstance(seed, torch.Tensor) else [seed] * n
    offs = offset.tolist() if isinstance(offset, torch.Tensor) else [offset] * n
    for i in range(n):
        g = torch.Generator().manual_seed((seeds[i] ^ (i << 40) ^ (offs[i] * 0x9E3779B97F4A7C15)) & (2**63 - 1))
        u[i] = torch.rand(n_u, generator=g)
    return u


# ----------------------------------------------------------------------------------------------- torch path


def _per_row(v, n: int, device, dtype) -> torch.Tensor:
    if isinstance(v, torch.Tensor):
        return v.to(device=device, dtype=dtype)
    return torch.full((n,), v, device=device, dtype=dtype)


def _torch_keep(x32: torch.Tensor, k, p, k_first: bool) -> torch.Tensor:
    """Kept-set mask of top-k and/or top-p (``x32``: ``[n, V]`` float32 probabilities or logits)."""
    n, V = x32.shape
    keep = torch.ones_like(x32, dtype=torch.bool)
    if k is not None:
        kk = _per_row(k, n, x32.device, torch.int64)
        srt = torch.sort(x32, dim=1, descending=True).values
        tk = srt.gather(1, (kk.clamp(1, V) - 1)[:, None])
        active = ((kk > 0) & (kk < V))[:, None]
        keep &= ~active | (x32 >= tk)
    if p is not None:
        pp = _per_row(p, n, x32.device, torch.float32)
        base = torch.where(keep, x32, 0.0) if k_first else x32
        srt = torch.sort(base, dim=1, descending=True).values
        cs = torch.cumsum(srt, dim=1)
        target = (pp * base.sum(dim=1))[:, None]
        m = torch.searchsorted(cs, target.contiguous()).clamp(max=V - 1)
        tp = srt.gather(1, m)
        keep &= ~(pp < 1.0)[:, None] | (x32 >= tp)
    return keep


def _torch_draw(w: torch.Tensor, u: torch.Tensor):
    """Inverse-CDF index per row of nonnegative weights ``w`` and whether the row had any mass."""
    cs = torch.cumsum(w, dim=1)
    total = cs[:, -1:]
    idx = torch.searchsorted(cs, (u[:, :1] * total).contiguous(), right=True)[:, 0]
    pos = torch.arange(w.shape[1], device=w.device).expand_as(w)
    last = torch.where(w > 0, pos, -1).max(dim=1).values
    idx = torch.where((idx >= w.shape[1]) | (idx > last), last, idx)
    return idx.clamp(min=0), total[:, 0] > 0


# ----------------------------------------------------------------------------------------------- top-p rounds

# The rejection rounds' bounds (kernels/sampling.py, _topp_reject_kernel, uses the same): round 0 proposes against
# c_0 = 1 + 2^-10 (no pass precedes it, and probabilities sum to about 1), later rounds against the previous
# round's mass above ``low`` times 1 + 2^-12 (far above a float32 sum's rounding), and round 0's proposals count
# only where the row's sum M <= c_0 (1 - 2^-16).
_C0 = 1.0 + 2.0**-10
_GROW = 1.0 + 2.0**-12
_USABLE0 = 1.0 - 2.0**-16


def _topp_uniforms(n: int, cfg: _config.SamplingConfig) -> int:
    """Uniforms a row takes for top-p alone in a batch of ``n`` rows: ``cfg.topp_proposals_at(n)`` a round over
    ``topp_rounds`` rounds, and one for the exact fallback."""
    return cfg.topp_rounds * cfg.topp_proposals_at(n) + 1


def _above(x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """G(v) per row: the mass strictly above ``v[row]``."""
    return torch.where(x > v[:, None], x, 0.0).sum(dim=1)


def _torch_topp_reject(x32: torch.Tensor, p, u: torch.Tensor, K: int, R: int):
    """The kernel's rejection rounds over all rows at once, in float64 (the kernel sums in float32: the two differ
    only where a decision lies within float32 rounding of its threshold). Returns the drawn index (-1: none yet),
    whether the row has mass, and the rows left to the exact fallback."""
    n, V = x32.shape
    x = x32.double()
    dev = x.device
    top_p = _per_row(p, n, dev, torch.float32).double()
    M = x.sum(dim=1)
    target = torch.where(top_p < 1.0, top_p * M, float("inf"))
    usable0 = M <= _C0 * _USABLE0
    low = torch.zeros(n, dtype=torch.float64, device=dev)
    high = torch.full((n,), _C0, dtype=torch.float64, device=dev)
    q = high.clone()
    res = torch.full((n,), -1, dtype=torch.int64, device=dev)
    nonempty = M > 0
    active = nonempty.clone()
    uu = u.double()
    for r in range(R):
        if not bool(active.any()):
            break
        c = q * _GROW if r > 0 else q
        cs = torch.cumsum(torch.where(x > low[:, None], x, 0.0), dim=1)
        props = []
        for j in range(K):
            t = (uu[:, r * K + j] * c)[:, None].contiguous()
            i = torch.searchsorted(cs, t, right=True)[:, 0]  # the first index whose running mass exceeds t
            props.append(torch.where(i < V, i, -1))
        high_piv = high  # (round 0's upper pivots halve towards c_0, before M is known)
        if r == 0:
            high = torch.minimum(high, M)
            q = M
            use = usable0
        else:
            use = torch.ones_like(usable0)
        decided = torch.zeros_like(active)
        nl, nq, nh = low, q, high
        for i in props:
            found = active & (i >= 0)
            x0 = x.gather(1, i.clamp(min=0)[:, None])[:, 0]
            g0 = _above(x, x0)
            acc = found & ~decided & use & ((g0 < target) | (g0 == 0))
            res = torch.where(acc, i, res)
            decided |= acc
            x1 = ((x0.float() + high_piv.float()) * 0.5).double()  # (the kernel's float32 midpoint)
            g1 = _above(x, x1)
            up = found & (g0 >= target) & (g0 != 0) & (x0 > nl)
            nl, nq = torch.where(up, x0, nl), torch.where(up, g0, nq)
            hi1 = found & (g1 >= target) & (g1 != 0)
            up = hi1 & (x1 > nl)
            nl, nq = torch.where(up, x1, nl), torch.where(up, g1, nq)
            nh = torch.where(found & ~hi1, torch.minimum(nh, x1), nh)
        active &= ~decided
        low, q, high = torch.where(active, nl, low), torch.where(active, nq, q), torch.where(active, nh, high)
    return res, nonempty, active


# ----------------------------------------------------------------------------------------------- sampling


class _Draw(enum.Enum):
    """How a sampling call turns its uniforms into tokens."""

    #: the exact kept set (a threshold, when a filter is given), then one uniform per row through its inverse CDF
    INVERSE_CDF = "inverse_cdf"
    #: top-p alone: rejection rounds over the row, ``topp_rounds * topp_proposals_at(batch) + 1`` uniforms a row
    TOP_P_REJECTION = "top_p_rejection"


def _draw_rule(k, p, minp, from_logits: bool, given_uniforms: bool) -> _Draw:
    """The draw a call takes. Top-p alone is drawn by rejection rounds, which need no threshold unless a row runs out
    of rounds. Everything else that filters (top-k, top-k with top-p, min-p) needs the exact threshold anyway, and
    a FlashInfer 0.2 call's caller-drawn uniforms (one per row used) keep the inverse CDF."""
    if p is not None and k is None and minp is None and not from_logits and not given_uniforms:
        return _Draw.TOP_P_REJECTION
    return _Draw.INVERSE_CDF


def _sample(x, indices, k, p, minp, *, from_logits, k_first, deterministic, generator, seed, offset):
    _check_bool("deterministic", deterministic)
    n = _check_indices(indices, x)
    out_dtype = indices.dtype if indices is not None else torch.int32
    cfg = _config.SAMPLING
    rule = _draw_rule(k, p, minp, from_logits, GIVEN_UNIFORMS.get() is not None)
    reject = rule is _Draw.TOP_P_REJECTION
    u = _uniforms(n, _topp_uniforms(n, cfg) if reject else 1, x.device, generator, seed, offset)
    out = torch.empty(n, dtype=out_dtype, device=x.device)
    valid = torch.empty(n, dtype=torch.bool, device=x.device)
    if n > 0 and use_triton(x.device):
        from .kernels.sampling import launch_sample, launch_topp_reject

        if indices is not None and not indices.is_contiguous():  # the kernels read indices[i] at offset i
            indices = indices.contiguous()
        if reject:
            launch_topp_reject(x, indices, u, out, valid, p, cfg)
        else:
            launch_sample(x, indices, u, out, valid, k, p, minp, from_logits, k_first)
        return out, valid
    if n == 0:
        return out, valid
    rows = x[indices.long()] if indices is not None else x
    x32 = rows.float()
    if reject:
        # The same rounds as the kernel on the same uniforms, so a CPU call draws what the kernel draws from them.
        K, R = cfg.topp_proposals_at(n), cfg.topp_rounds
        idx, ok, rest = _torch_topp_reject(x32, p, u, K, R)
        if bool(rest.any()):
            sel = rest.nonzero()[:, 0]
            ps = p[sel] if isinstance(p, torch.Tensor) else p
            xs = x32[sel]
            fb, _ = _torch_draw(torch.where(_torch_keep(xs, None, ps, False), xs, 0.0), u[sel, R * K :])
            idx[sel] = fb
        out.copy_(idx.clamp(min=0))
        valid.copy_(ok)
        return out, valid
    if from_logits:
        w = torch.softmax(x32, dim=1)
    elif minp is not None:
        mp = _per_row(minp, n, x.device, torch.float32)
        w = torch.where(x32 >= mp[:, None] * x32.max(dim=1, keepdim=True).values, x32, 0.0)
    else:
        w = torch.where(_torch_keep(x32, k, p, k_first), x32, 0.0)
    idx, ok = _torch_draw(w, u)
    out.copy_(idx)
    valid.copy_(ok)
    return out, valid


def _ret(res, return_valid: bool):
    return res if _check_bool("return_valid", return_valid) else res[0]


def sampling_from_probs(
    probs, indices=None, deterministic=True, generator=None, check_nan=False, seed=None, offset=None, return_valid=False
):
    """One token per row of ``probs [num_rows, vocab]`` (need not be normalised), drawn with probability
    proportional to its entry. Returns ``samples`` (and ``valid`` with ``return_valid``)."""
    probs = _check_rows("probs", probs)
    _check_nan(probs, check_nan, "probs")
    res = _sample(probs, indices, None, None, None, from_logits=False, k_first=False,
                  deterministic=deterministic, generator=generator, seed=seed, offset=offset)  # fmt: skip
    return _ret(res, return_valid)


def sampling_from_logits(
    logits, indices=None, deterministic=True, generator=None, check_nan=False, seed=None, offset=None
):  # fmt: skip
    """One token per row drawn from ``softmax(logits)`` (fused: no probability tensor is written)."""
    logits = _check_rows("logits", logits)
    _check_nan(logits, check_nan, "logits")
    return _sample(logits, indices, None, None, None, from_logits=True, k_first=False,
                   deterministic=deterministic, generator=generator, seed=seed, offset=offset)[0]  # fmt: skip


def top_p_sampling_from_probs(
    probs, top_p, indices=None, deterministic=True, generator=None, check_nan=False, seed=None, offset=None,
    return_valid=False,
):  # fmt: skip
    """Sample from the smallest top set of mass ``>= top_p`` (scalar or per-row tensor), renormalised."""
    probs = _check_rows("probs", probs)
    n = _check_indices(indices, probs)
    top_p = _param("top_p", top_p, n, probs.device, False, 0.0, 1.0)
    _check_nan(probs, check_nan, "probs")
    res = _sample(probs, indices, None, top_p, None, from_logits=False, k_first=False,
                  deterministic=deterministic, generator=generator, seed=seed, offset=offset)  # fmt: skip
    return _ret(res, return_valid)


def top_k_sampling_from_probs(
    probs, top_k, indices=None, deterministic=True, generator=None, check_nan=False, seed=None, offset=None,
    return_valid=False,
):  # fmt: skip
    """Sample from the ``top_k`` (scalar or per-row tensor) largest probabilities, renormalised."""
    probs = _check_rows("probs", probs)
    n = _check_indices(indices, probs)
    top_k = _param("top_k", top_k, n, probs.device, True)
    _check_nan(probs, check_nan, "probs")
    res = _sample(probs, indices, top_k, None, None, from_logits=False, k_first=False,
                  deterministic=deterministic, generator=generator, seed=seed, offset=offset)  # fmt: skip
    return _ret(res, return_valid)


def min_p_sampling_from_probs(
    probs, min_p, indices=None, deterministic=True, generator=None, check_nan=False, seed=None, offset=None,
    return_valid=False,
):  # fmt: skip
    """Sample from the probabilities ``>= min_p * max(row)`` (``min_p`` scalar or per-row tensor)."""
    probs = _check_rows("probs", probs)
    n = _check_indices(indices, probs)
    min_p = _param("min_p", min_p, n, probs.device, False, 0.0, 1.0)
    _check_nan(probs, check_nan, "probs")
    res = _sample(probs, indices, None, None, min_p, from_logits=False, k_first=False,
                  deterministic=deterministic, generator=generator, seed=seed, offset=offset)  # fmt: skip
    return _ret(res, return_valid)


def top_k_top_p_sampling_from_probs(
    probs, top_k, top_p, indices=None, filter_apply_order="top_k_first", deterministic=True, generator=None,
    check_nan=False, seed=None, offset=None, return_valid=False,
):  # fmt: skip
    """Sample under both filters: top-p on the renormalised top-k set (``"top_k_first"``) or the
    intersection of the two sets (``"joint"``)."""
    probs = _check_rows("probs", probs)
    n = _check_indices(indices, probs)
    if filter_apply_order not in _ORDERS:
        raise ValueError(f"Invalid filter_apply_order: {filter_apply_order!r} (expected 'top_k_first' or 'joint')")
    top_k = _param("top_k", top_k, n, probs.device, True)
    top_p = _param("top_p", top_p, n, probs.device, False, 0.0, 1.0)
    _check_nan(probs, check_nan, "probs")
    res = _sample(probs, indices, top_k, top_p, None, from_logits=False, k_first=filter_apply_order == "top_k_first",
                  deterministic=deterministic, generator=generator, seed=seed, offset=offset)  # fmt: skip
    return _ret(res, return_valid)


def top_k_top_p_sampling_from_logits(
    logits, top_k, top_p, indices=None, filter_apply_order="top_k_first", deterministic=True, generator=None,
    check_nan=False, seed=None, offset=None,
):  # fmt: skip
    """``top_k_top_p_sampling_from_probs`` of ``softmax(logits)`` (for ``"top_k_first"`` the same
    distribution as FlashInfer's softmax of the top-k masked logits)."""
    logits = _check_rows("logits", logits)
    if filter_apply_order not in _ORDERS:
        raise ValueError(f"Invalid filter_apply_order: {filter_apply_order!r} (expected 'top_k_first' or 'joint')")
    n = _check_indices(indices, logits)
    _param("top_k", top_k, n, logits.device, True)
    _param("top_p", top_p, n, logits.device, False, 0.0, 1.0)
    _check_nan(logits, check_nan, "logits")
    probs = softmax(logits)
    return top_k_top_p_sampling_from_probs(
        probs, top_k, top_p, indices, filter_apply_order, deterministic, generator, False, seed, offset
    )


# ----------------------------------------------------------------------------------------------- transforms


def softmax(logits, temperature=None, enable_pdl=None) -> torch.Tensor:
    """Row softmax of ``logits / temperature`` (scalar or per-row tensor; None: 1) in float32."""
    logits = _check_rows("logits", logits)
    if enable_pdl is not None and not isinstance(enable_pdl, bool):
        raise type_error("enable_pdl", "None or a bool", type(enable_pdl).__name__)
    n = logits.shape[0]
    if temperature is None:
        temperature = 1.0
    if isinstance(temperature, torch.Tensor):
        temperature = _param("temperature", temperature, n, logits.device, False)
    else:
        temperature = _param("temperature", temperature, n, logits.device, False, 0.0, float("inf"))
        if temperature <= 0.0:
            raise value_error("temperature", "a value > 0", temperature)
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    if use_triton(logits.device):
        from .kernels.sampling import launch_softmax

        launch_softmax(logits, out, temperature, enable_pdl)
    else:
        t = _per_row(temperature, n, logits.device, torch.float32)[:, None]
        out.copy_(torch.softmax(logits.float() / t, dim=1))
    return out


def _renorm(x, k, p, mask_logits: bool) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=x.dtype if mask_logits else torch.float32, device=x.device)
    if use_triton(x.device):
        from .kernels.sampling import launch_renorm

        launch_renorm(x, out, k, p, mask_logits)
        return out
    x32 = x.float()
    keep = _torch_keep(x32, k, p, False)
    if mask_logits:
        out.copy_(torch.where(keep, x32, float("-inf")))
    else:
        w = torch.where(keep, x32, 0.0)
        out.copy_(w / w.sum(dim=1, keepdim=True))
    return out


def top_p_renorm_probs(probs, top_p, is_deterministic=False) -> torch.Tensor:
    """Probabilities outside the top-p set zeroed, the rest renormalised (float32)."""
    probs = _check_rows("probs", probs)
    _check_bool("is_deterministic", is_deterministic)
    top_p = _param("top_p", top_p, probs.shape[0], probs.device, False, 0.0, 1.0)
    return _renorm(probs, None, top_p, False)


def top_k_renorm_probs(probs, top_k, is_deterministic=False) -> torch.Tensor:
    """Probabilities outside the top-k set zeroed, the rest renormalised (float32)."""
    probs = _check_rows("probs", probs)
    _check_bool("is_deterministic", is_deterministic)
    top_k = _param("top_k", top_k, probs.shape[0], probs.device, True)
    return _renorm(probs, top_k, None, False)


def top_k_mask_logits(logits, top_k) -> torch.Tensor:
    """Logits outside the top-k set set to -inf (dtype of ``logits``)."""
    logits = _check_rows("logits", logits)
    top_k = _param("top_k", top_k, logits.shape[0], logits.device, True)
    return _renorm(logits, top_k, None, True)


# ----------------------------------------------------------------------------------------------- speculative


def chain_speculative_sampling(
    draft_probs,
    draft_token_ids,
    target_probs,
    maybe_output_accepted_token_num=None,
    maybe_output_emitted_draft_token_num=None,
    deterministic=True,
    generator=None,
    seed=None,
    offset=None,
):
    """Speculative sampling of a chain of ``n`` draft tokens per request: draft token ``i`` is accepted
    while ``u_i * q_i < p_i`` (``q``: draft probability, ``p``: target probability of that token); the
    first rejected position is drawn from ``relu(p - q)`` renormalised (after ``n`` acceptances, the bonus
    token from ``p``); later positions are -1. Returns ``(output_token_ids [b, n + 1],
    accepted_token_num [b], emitted_draft_token_num [b])``; the counts are added to the given tensors."""
    check_tensor("draft_probs", draft_probs, dim=3, dtypes=_FLOATS)
    b, n, V = draft_probs.shape
    dev = draft_probs.device
    check_tensor("draft_token_ids", draft_token_ids, dim=2, dtypes=_IDX, device=dev)
    if tuple(draft_token_ids.shape) != (b, n):
        raise value_error("draft_token_ids", f"shape [{b}, {n}]", shape_str(draft_token_ids.shape))
    check_tensor("target_probs", target_probs, dim=3, dtypes=_FLOATS, device=dev)
    if tuple(target_probs.shape) != (b, n + 1, V):
        raise value_error("target_probs", f"shape [{b}, {n + 1}, {V}]", shape_str(target_probs.shape))
    _check_bool("deterministic", deterministic)
    counts = []
    for name, t in (
        ("maybe_output_accepted_token_num", maybe_output_accepted_token_num),
        ("maybe_output_emitted_draft_token_num", maybe_output_emitted_draft_token_num),
    ):
        if t is None:
            t = torch.zeros(b, dtype=torch.int32, device=dev)
        else:
            check_tensor(name, t, dim=1, dtypes=(torch.int32,), device=dev)
            if t.shape[0] != b:
                raise value_error(name, f"shape [{b}]", shape_str(t.shape))
        counts.append(t)
    acc, emit = counts
    u = _uniforms(b, n + 1, dev, generator, seed, offset)
    out = torch.empty((b, n + 1), dtype=draft_token_ids.dtype, device=dev)
    if b == 0:
        return out, acc, emit
    if use_triton(dev):
        from .kernels.sampling import launch_chain

        launch_chain(
            draft_probs.contiguous(), draft_token_ids.contiguous(), target_probs.contiguous(), u, out, acc, emit
        )
        return out, acc, emit
    q_all = draft_probs.float()
    p_all = target_probs.float()
    ids = draft_token_ids.long()
    q_tok = q_all.gather(2, ids[:, :, None])[:, :, 0]
    p_tok = p_all[:, :n].gather(2, ids[:, :, None])[:, :, 0]
    ok = u[:, :n] * q_tok < p_tok  # [b, n]
    pos = torch.where(ok.all(dim=1), n, (~ok).int().argmax(dim=1))
    acc += ok.sum(dim=1).int()
    emit += pos.int()
    rows = torch.arange(b, device=dev)
    p_pos = p_all[rows, pos]
    q_pos = torch.where((pos < n)[:, None], q_all[rows, pos.clamp(max=max(n - 1, 0))] if n else 0.0, 0.0)
    idx, _ = _torch_draw((p_pos - q_pos).clamp(min=0.0), u[:, n:])
    j = torch.arange(n + 1, device=dev)[None, :]
    res = torch.where(j < pos[:, None], torch.cat([ids, ids[:, :1]], dim=1), -1)
    res = torch.where(j == pos[:, None], idx[:, None], res)
    out.copy_(res)
    return out, acc, emit


# FlashInfer 0.2's forms, with caller-drawn uniform_samples, told apart by that argument (_sampling_v02)
sampling_from_probs = accepts_v02_uniforms(sampling_from_probs)
top_p_sampling_from_probs = accepts_v02_uniforms(top_p_sampling_from_probs)
top_k_sampling_from_probs = accepts_v02_uniforms(top_k_sampling_from_probs)
min_p_sampling_from_probs = accepts_v02_uniforms(min_p_sampling_from_probs)
top_k_top_p_sampling_from_probs = accepts_v02_uniforms(top_k_top_p_sampling_from_probs)
top_k_top_p_sampling_from_logits = accepts_v02_uniforms(
    top_k_top_p_sampling_from_logits, top_k_top_p_sampling_from_probs
)
chain_speculative_sampling = accepts_v02_uniforms(chain_speculative_sampling)
