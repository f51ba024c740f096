"""FlashInfer 0.2's sampling call forms, with caller-drawn ``uniform_samples``.

In 0.2 the caller drew the uniforms: ``sampling_from_probs(probs, uniform_samples [B])`` returned the samples,
the filtered samplers ``(probs, uniform_samples [rounds, B], top_k / top_p / min_p, ..., deterministic,
check_nan)`` returned ``(samples, success)``, and ``chain_speculative_sampling(draft_probs, draft_token_ids,
uniform_samples [B, n + 1], target_probs, ...)`` its three tensors. 0.7 draws them itself and puts the filter
parameter (or ``indices``, or ``target_probs``) in that slot.

The two are told apart by that argument: a floating tensor of 0.2's rank (1-D for ``sampling_from_probs``,
whose 0.7 slot holds integer ``indices``; 2-D elsewhere, where 0.7 takes a number, a 1-D per-row tensor or a 3-D
``target_probs``), or the keyword ``uniform_samples``. The call then runs 0.7's function on the caller's
uniforms, each sample by one inverse CDF of the filtered distribution (top-p alone too, which otherwise draws by
rejection rounds with uniforms of its own count), so a filtered sampler uses round 0 of ``uniform_samples`` and
always succeeds where the row has mass (``success`` is the row's ``valid``); the samples follow the same
distribution as FlashInfer 0.2's rejection rounds, not the same tokens.
"""

from __future__ import annotations

import contextvars
import functools
import inspect

import torch

from ._checks import check_tensor, shape_str, value_error

# the uniforms of the call in progress, [rows, draws] float32 (None: draw them)
GIVEN_UNIFORMS: contextvars.ContextVar = contextvars.ContextVar("flashinfer_triton_given_uniforms", default=None)


def _sampling_from_probs(probs, uniform_samples, deterministic=True, check_nan=False):
    """0.2's parameters (bound, never called); likewise below."""


def _top_p(probs, uniform_samples, top_p, deterministic=True, check_nan=False):
    """0.2's parameters."""


def _top_k(probs, uniform_samples, top_k, deterministic=True, check_nan=False):
    """0.2's parameters."""


def _min_p(probs, uniform_samples, min_p, deterministic=True, check_nan=False):
    """0.2's parameters."""


def _top_k_top_p(probs, uniform_samples, top_k, top_p, filter_apply_order="top_k_first", deterministic=True,
                 check_nan=False):  # fmt: skip
    """0.2's parameters (``probs`` holds logits for ``top_k_top_p_sampling_from_logits``)."""


def _chain(draft_probs, draft_token_ids, uniform_samples, target_probs, maybe_output_accepted_token_num=None,
           maybe_output_emitted_token_num=None, deterministic=True):  # fmt: skip
    """0.2's parameters."""


# name: (0.2's signature, position of uniform_samples, its rank)
_FORMS = {
    "sampling_from_probs": (_sampling_from_probs, 1, 1),
    "top_p_sampling_from_probs": (_top_p, 1, 2),
    "top_k_sampling_from_probs": (_top_k, 1, 2),
    "min_p_sampling_from_probs": (_min_p, 1, 2),
    "top_k_top_p_sampling_from_probs": (_top_k_top_p, 1, 2),
    "top_k_top_p_sampling_from_logits": (_top_k_top_p, 1, 2),
    "chain_speculative_sampling": (_chain, 2, 2),
}


def _uniforms(u, rows: int, name: str, ref: torch.Tensor, chain_draws: int | None) -> torch.Tensor:
    """0.2's ``uniform_samples`` as the ``[rows, draws]`` float32 tensor the samplers draw with."""
    check_tensor("uniform_samples", u, device=ref.device)
    if not u.is_floating_point():
        raise value_error("uniform_samples", "a floating tensor", str(u.dtype).replace("torch.", ""))
    if chain_draws is not None:
        want = (rows, chain_draws)
        if tuple(u.shape) != want:
            raise value_error("uniform_samples", f"shape [{rows}, {chain_draws}]", shape_str(u.shape))
        return u.float().contiguous()
    if name == "sampling_from_probs":
        if tuple(u.shape) != (rows,):
            raise value_error("uniform_samples", f"shape [{rows}]", shape_str(u.shape))
        return u.float().reshape(rows, 1).contiguous()
    if u.dim() != 2 or u.shape[0] < 1 or u.shape[1] != rows:
        raise value_error("uniform_samples", f"shape [rounds >= 1, {rows}]", shape_str(u.shape))
    return u[0].float().reshape(rows, 1).contiguous()


def accepts_v02_uniforms(fn, probs_fn=None):
    """``fn`` (a 0.7 sampler of this package) that also takes 0.2's form (module docstring). ``probs_fn``:
    for ``top_k_top_p_sampling_from_logits``, the probability sampler its 0.2 form runs on the softmax."""
    v02, slot, rank = _FORMS[fn.__name__]
    sig = inspect.signature(v02)
    name = fn.__name__

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        u = args[slot] if len(args) > slot else None
        v02_form = "uniform_samples" in kwargs or (
            isinstance(u, torch.Tensor) and u.is_floating_point() and u.dim() == rank
        )
        if not v02_form:
            return fn(*args, **kwargs)
        a = sig.bind(*args, **kwargs)
        a.apply_defaults()
        a = a.arguments
        if name == "chain_speculative_sampling":
            check_tensor("draft_probs", a["draft_probs"], dim=3)
            b, n, _ = a["draft_probs"].shape
            given = _uniforms(a["uniform_samples"], b, name, a["draft_probs"], n + 1)
            call = functools.partial(
                fn, a["draft_probs"], a["draft_token_ids"], a["target_probs"], a["maybe_output_accepted_token_num"],
                a["maybe_output_emitted_token_num"], a["deterministic"],
            )  # fmt: skip
        else:
            probs = a["probs"]
            check_tensor("probs", probs, dim=2)
            given = _uniforms(a["uniform_samples"], probs.shape[0], name, probs, None)
            opts = dict(deterministic=a["deterministic"], check_nan=a["check_nan"])
            params = [a[p] for p in ("top_k", "top_p", "min_p") if p in a]
            if "filter_apply_order" in a:
                opts["filter_apply_order"] = a["filter_apply_order"]
            if name == "sampling_from_probs":
                call = functools.partial(fn, probs, **opts)
            elif probs_fn is not None:  # 0.7's from-logits sampler is the probability sampler of the softmax
                from .sampling import _check_nan, softmax

                _check_nan(probs, a["check_nan"], "logits")
                opts["check_nan"] = False
                call = functools.partial(probs_fn, softmax(probs), *params, return_valid=True, **opts)
            else:
                call = functools.partial(fn, probs, *params, return_valid=True, **opts)
        token = GIVEN_UNIFORMS.set(given)
        try:
            return call()
        finally:
            GIVEN_UNIFORMS.reset(token)

    wrapper.__flashinfer_v02_order__ = tuple(sig.parameters)
    return wrapper
