"""Fused RMSNorm and rotary kernels inside a transformers model's forward (reversible, Liger-style patches).

Inside `with FusedLayers(model, ops):` the model's RMSNorm modules run `ops.rms_norm` (one kernel instead of
seven elementwise ones) and its modeling module's `apply_rotary_pos_emb` runs `ops.apply_rotary` (one kernel
for the queries and keys of a layer instead of about twelve); on exit both are restored. The kernels round
where transformers' ops round, so outputs match the unpatched model to the last bit or an ulp. Keyed by
config.model_type; other types raise. The rotary patch is a module global: while the context is open it also
applies to other models of the same type in this process. Calls the kernels do not take (another dtype for
cos/sin, unsqueeze_dim != 1, a head_dim that is not a power of two) fall through to transformers' function.
With projections=True (the engine's default, EngineConfig.fused_projections) the q/k/v products of each
attention and the gate/up products of each MLP also run as one matmul each (fuse_projections). With
mlp_chunk_tokens=n (the engine's EngineConfig.mlp_chunk_tokens) an MLP called on more than n tokens runs on
n at a time (chunk_mlps): a prefill forward's peak activations, which the engine sets aside from its cache
budget, then hold one chunk's gate/up products instead of the whole forward's. With projections and
silu_mul=True (the engine's EngineConfig.fused_silu_mul) SwiGLU MLPs (a SiLU act_fn) also run `ops.silu_mul` on
the gate/up product: one kernel for act_fn(gate) * up, with no intermediate (silu_mul_mlps).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch

from kivi_kernels import KernelOps

# model_type -> (modeling module that defines apply_rotary_pos_emb, RMSNorm class name)
FUSED_MODEL_TYPES = {
    "llama": ("transformers.models.llama.modeling_llama", "LlamaRMSNorm"),
    "mistral": ("transformers.models.mistral.modeling_mistral", "MistralRMSNorm"),
    "qwen2": ("transformers.models.qwen2.modeling_qwen2", "Qwen2RMSNorm"),
    "qwen3": ("transformers.models.qwen3.modeling_qwen3", "Qwen3RMSNorm"),
}


def _rotary_takes(q, k, cos, sin, args, kwargs) -> bool:
    """True when the call is the plain form the kernel implements (else transformers' function runs)."""
    if args or set(kwargs) - {"unsqueeze_dim"} or kwargs.get("unsqueeze_dim", 1) != 1:
        return False
    if not all(isinstance(t, torch.Tensor) for t in (q, k, cos, sin)) or q.dim() != 4 or k.dim() != 4:
        return False
    D = q.shape[-1]
    return (cos.dtype == sin.dtype == q.dtype == k.dtype and D % 2 == 0 and D & (D - 1) == 0
            and cos.shape == sin.shape == (q.shape[0], q.shape[2], D))


def _fused_weights(linears: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None, list[int]] | None:
    """One weight (and bias) tensor whose row slices the linears' parameters become (no extra memory once the
    old ones go); the one made before when they are still its slices. None if they cannot be fused."""
    first = linears[0].weight
    has_bias = [lin.bias is not None for lin in linears]
    if any(lin.weight.shape[1] != first.shape[1] or lin.weight.dtype != first.dtype
           or lin.weight.device != first.device for lin in linears) or len(set(has_bias)) != 1:
        return None
    made = getattr(linears[0], "_kivi_fused", None)
    if made is not None and all(lin.weight.untyped_storage().data_ptr() == made[0].untyped_storage().data_ptr()
                                for lin in linears):
        return made  # fused already (another engine on this model): fusing again would copy the weights
    sizes = [lin.weight.shape[0] for lin in linears]
    with torch.no_grad():
        weight = torch.cat([lin.weight for lin in linears])
        bias = torch.cat([lin.bias for lin in linears]) if has_bias[0] else None
        for i, (lin, w) in enumerate(zip(linears, weight.split(sizes), strict=True)):
            lin.weight = torch.nn.Parameter(w, requires_grad=False)
            if bias is not None:
                lin.bias = torch.nn.Parameter(bias.split(sizes)[i], requires_grad=False)
    linears[0]._kivi_fused = (weight, bias, sizes)
    return linears[0]._kivi_fused


def _fuse_linears(linears: list[torch.nn.Linear], stash: dict) -> list[tuple[torch.nn.Module, Callable]]:
    """Forwards under which the first linear computes all the linears' products in one matmul and the others
    return their slice of it when called on the same input tensor (any other input: their own product).
    `stash` holds the input and the slices between those calls. [] if they cannot be fused."""
    fused = _fused_weights(linears)
    if fused is None:
        return []
    weight, bias, sizes = fused

    def lead(x):
        parts = torch.nn.functional.linear(x, weight, bias).split(sizes, dim=-1)
        stash.update(x=x, parts=parts)
        return parts[0]

    def follower(i: int, lin: torch.nn.Linear):
        def forward(x):
            if stash.get("x") is x:
                part = stash["parts"][i]
                if i == len(sizes) - 1:
                    stash.clear()  # the last one: hold no activations past this layer
                return part
            return torch.nn.functional.linear(x, lin.weight, lin.bias)

        return forward

    return [(linears[0], lead)] + [(lin, follower(i, lin)) for i, lin in enumerate(linears) if i > 0]


def fuse_projections(model: torch.nn.Module) -> tuple[list[tuple[torch.nn.Module, Callable]], list[dict]]:
    """Fused q/k/v and gate/up products for every attention and MLP module that has them as plain nn.Linear
    (see _fuse_linears): the patches, and the stashes to clear when a forward ends early."""
    patches, stashes = [], []
    for module in model.modules():
        for names in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
            linears = [getattr(module, n, None) for n in names]
            if all(type(lin) is torch.nn.Linear for lin in linears):  # not quantized subclasses
                stashes.append({})
                patches += _fuse_linears(linears, stashes[-1])
    return patches, stashes


def _is_silu(act) -> bool:
    from transformers import activations

    return type(act) in (torch.nn.SiLU, getattr(activations, "SiLUActivation", torch.nn.SiLU))


def silu_mul_mlps(model: torch.nn.Module, silu_mul: Callable) -> dict[torch.nn.Module, Callable]:
    """Forwards for the SwiGLU MLP modules whose gate/up products were fused (fuse_projections; a SiLU act_fn):
    down_proj(silu_mul(x @ [gate; up]^T)), i.e. transformers' down_proj(act_fn(gate_proj(x)) * up_proj(x)) with
    the activation and the product as one kernel and no intermediate. Other MLPs are left out, and so are modules
    with a forward of their own (accelerate's hooks), which this forward would bypass."""
    forwards = {}
    for module in model.modules():
        if "forward" in vars(module) or hasattr(module, "_hf_hook"):
            continue
        gate, up, down = (getattr(module, n, None) for n in ("gate_proj", "up_proj", "down_proj"))
        if not (type(gate) is type(up) is torch.nn.Linear and isinstance(down, torch.nn.Module)
                and _is_silu(getattr(module, "act_fn", None))):
            continue
        fused = _fused_weights([gate, up])  # the one fuse_projections made (its weights are still slices of it)
        if fused is None:
            continue
        weight, bias, _ = fused

        def forward(x, weight=weight, bias=bias, down=down):
            return down(silu_mul(torch.nn.functional.linear(x, weight, bias)))  # [..., 2 I] -> [..., I] -> hidden

        forwards[module] = forward
    return forwards


def chunk_mlps(model: torch.nn.Module, chunk_tokens: int,
               forwards: dict[torch.nn.Module, Callable] | None = None) -> list[tuple[torch.nn.Module, Callable]]:
    """Forwards under which every MLP module (gate_proj, up_proj and down_proj) runs its input in chunks of at
    most chunk_tokens tokens, the outputs written into one tensor; calls on fewer tokens (decode) run as they are.
    An MLP acts on each token alone, so only the matmuls' shapes change (their rounding may, by an ulp). Each
    chunk runs `forwards[module]` where given (silu_mul_mlps), else the module's own forward."""
    if not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"mlp_chunk_tokens must be a positive int, got {chunk_tokens!r}")

    def chunked(original):
        def forward(x):
            rows = x.numel() // max(x.shape[-1], 1)
            if rows <= chunk_tokens:
                return original(x)
            flat = x.reshape(rows, x.shape[-1])  # [T, hidden]
            parts = [original(flat[start:start + chunk_tokens]) for start in range(0, rows, chunk_tokens)]
            return torch.cat(parts).view(*x.shape[:-1], parts[0].shape[-1])

        return forward

    names, forwards = ("gate_proj", "up_proj", "down_proj"), forwards or {}
    return [(module, chunked(forwards.get(module, module.forward))) for module in model.modules()
            if all(isinstance(getattr(module, n, None), torch.nn.Module) for n in names)]


class FusedLayers:
    """Context manager: RMSNorm and rotary kernels of `ops` in `model`'s forward while it is open; with
    projections=True also one matmul for q/k/v and one for gate/up (fuse_projections: the weights become
    views of fused tensors at construction, for good) and, with silu_mul too, one SiLU-and-multiply kernel in
    SwiGLU MLPs (silu_mul_mlps); with mlp_chunk_tokens, MLPs in chunks of that many tokens (chunk_mlps)."""

    def __init__(self, model: torch.nn.Module, ops: KernelOps, projections: bool = False,
                 mlp_chunk_tokens: int | None = None, silu_mul: bool = False) -> None:
        model_type = getattr(model.config, "model_type", None)
        if model_type not in FUSED_MODEL_TYPES:
            raise ValueError(f"fused layers do not support model_type {model_type!r} "
                             f"(supported: {tuple(FUSED_MODEL_TYPES)})")
        module_name, norm_class = FUSED_MODEL_TYPES[model_type]
        self.modeling = importlib.import_module(module_name)
        self.norms = [m for m in model.modules() if type(m).__name__ == norm_class]
        if not self.norms:
            raise ValueError(f"no {norm_class} modules in this {model_type} model")
        self.ops, self.depth, self.original_rotary, self.saved_forwards = ops, 0, None, []
        self.patches = [(module, self._norm_forward(module)) for module in self.norms]
        self.stashes: list[dict] = []
        mlp_forwards = {}
        if projections:
            patches, self.stashes = fuse_projections(model)
            self.patches += patches
            if silu_mul:
                mlp_forwards = silu_mul_mlps(model, ops.silu_mul)
        if mlp_chunk_tokens is not None:
            self.patches += chunk_mlps(model, mlp_chunk_tokens, mlp_forwards)
        else:
            self.patches += list(mlp_forwards.items())

    def _norm_forward(self, module: torch.nn.Module):
        rms_norm, eps = self.ops.rms_norm, float(module.variance_epsilon)
        return lambda hidden_states: rms_norm(hidden_states, module.weight, eps)

    def _rotary(self, original):
        apply_rotary = self.ops.apply_rotary

        def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
            if _rotary_takes(q, k, cos, sin, args, kwargs):
                return apply_rotary(q, k, cos, sin)
            return original(q, k, cos, sin, *args, **kwargs)

        return apply_rotary_pos_emb

    def __enter__(self) -> FusedLayers:
        self.depth += 1
        if self.depth == 1:
            try:
                self.original_rotary = self.modeling.apply_rotary_pos_emb
                # an instance forward set by someone else (accelerate's hooks) is put back on exit
                self.saved_forwards = [vars(module).get("forward") for module, _ in self.patches]
                for module, forward in self.patches:
                    module.forward = forward  # an instance attribute shadows the class's
                self.modeling.apply_rotary_pos_emb = self._rotary(self.original_rotary)
            except BaseException:
                self.__exit__()  # all or nothing: `with` does not call __exit__ when __enter__ raises
                raise
        return self

    def __exit__(self, *exc) -> None:
        self.depth -= 1
        if self.depth == 0:
            for (module, _), saved in zip(self.patches, self.saved_forwards, strict=False):
                if saved is not None:
                    module.forward = saved
                elif "forward" in vars(module):
                    del module.forward
            if self.original_rotary is not None:
                self.modeling.apply_rotary_pos_emb = self.original_rotary
            for stash in self.stashes:
                stash.clear()  # a forward that raised between a group's products leaves its activations here
