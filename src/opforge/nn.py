"""``torch.nn.Module`` wrappers of the opforge operators, drop-in for their torch namesakes."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from opforge import functional
from opforge.core.errors import AttrError, ShapeError, UnsupportedError


class GELU(torch.nn.Module):
    """``torch.nn.GELU`` computed by `opforge.gelu` (erf form accurate in the tails)."""

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return functional.gelu(x, self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


class Sigmoid(torch.nn.Module):
    """``torch.nn.Sigmoid`` computed by `opforge.sigmoid` (overflow-free)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return functional.sigmoid(x)


class SiLU(torch.nn.Module):
    """``torch.nn.SiLU`` computed by `opforge.silu` (one division, overflow-free)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return functional.silu(x)


class SwiGLUMLP(torch.nn.Module):
    """A Llama-style gated MLP, ``down_proj(silu(gate_proj(x)) * up_proj(x))``, its gate
    step one `opforge.silu_mul` pass each way; the projections are ``torch.nn.Linear``
    named as transformers names them, so a transformers MLP's ``state_dict`` loads.

    Args:
        hidden_size, intermediate_size: the input/output width and the gated width.
        bias: whether the three projections have biases.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False,
                 device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        options = {"bias": bias, "device": device, "dtype": dtype}
        self.gate_proj = torch.nn.Linear(hidden_size, intermediate_size, **options)
        self.up_proj = torch.nn.Linear(hidden_size, intermediate_size, **options)
        self.down_proj = torch.nn.Linear(intermediate_size, hidden_size, **options)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(functional.silu_mul(self.gate_proj(x), self.up_proj(x)))


class GeGLUMLP(SwiGLUMLP):
    """A Gemma-style gated MLP, ``down_proj(gelu_tanh(gate_proj(x)) * up_proj(x))`` (GELU's
    tanh form), its gate step one `opforge.gelu_tanh_mul` pass each way; arguments and
    projections as `SwiGLUMLP`'s."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(functional.gelu_tanh_mul(self.gate_proj(x), self.up_proj(x)))


class Softmax(torch.nn.Module):
    """``torch.nn.Softmax`` computed by `opforge.softmax` (max-subtracted, float32
    statistics, online multi-block for long rows). ``dim=None`` follows torch's legacy
    rule: dim 0 for 0-, 1- and 3-D inputs, else dim 1."""

    def __init__(self, dim: int | None = None) -> None:
        super().__init__()
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dim = self.dim if self.dim is not None else (0 if x.ndim in (0, 1, 3) else 1)
        return functional.softmax(x, dim)

    def extra_repr(self) -> str:
        return f"dim={self.dim}"


class RMSNorm(torch.nn.Module):
    """``torch.nn.RMSNorm`` computed by `opforge.rms_norm`: same constructor, same
    ``weight`` parameter and state_dict keys. ``normalized_shape`` may span several trailing
    dims (they are normalised together); ``eps=None`` uses the machine epsilon of the
    compute dtype, as torch does: float32's for 16-bit inputs (their statistics are float32),
    else x's own."""

    def __init__(self, normalized_shape: int | Sequence[int], eps: float | None = None,
                 elementwise_affine: bool = True, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.normalized_shape = ((normalized_shape,) if isinstance(normalized_shape, int)
                                 else tuple(normalized_shape))
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = torch.nn.Parameter(torch.ones(self.normalized_shape, device=device,
                                                        dtype=dtype))
        else:
            self.register_parameter("weight", None)

    @property
    def variance_epsilon(self) -> float | None:
        """``eps`` under the name Hugging Face's RMSNorm modules give it."""
        return self.eps

    @variance_epsilon.setter
    def variance_epsilon(self, value: float | None) -> None:
        self.eps = value

    def reset_parameters(self) -> None:
        if self.weight is not None:
            torch.nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        count = len(self.normalized_shape)
        if tuple(x.shape[x.ndim - count:]) != self.normalized_shape:
            raise ShapeError("trailing dims must equal normalized_shape", op="RMSNorm",
                             param="x", expected=self.normalized_shape, got=tuple(x.shape))
        eps = (self.eps if self.eps is not None
               else torch.finfo(torch.promote_types(x.dtype, torch.float32)).eps)
        rows = x.reshape(*x.shape[:x.ndim - count], math.prod(self.normalized_shape))
        weight = None if self.weight is None else self.weight.reshape(-1)
        return functional.rms_norm(rows, weight, eps).reshape(x.shape)

    def extra_repr(self) -> str:
        return (f"{self.normalized_shape}, eps={self.eps}, "
                f"elementwise_affine={self.elementwise_affine}")


class LayerNorm(torch.nn.Module):
    """``torch.nn.LayerNorm`` computed by `opforge.layer_norm`: same constructor, same
    ``weight``/``bias`` parameters and state_dict keys."""

    def __init__(self, normalized_shape: int | Sequence[int], eps: float = 1e-5,
                 elementwise_affine: bool = True, bias: bool = True,
                 device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.normalized_shape = ((normalized_shape,) if isinstance(normalized_shape, int)
                                 else tuple(normalized_shape))
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        factory = {"device": device, "dtype": dtype}
        if elementwise_affine:
            self.weight = torch.nn.Parameter(torch.ones(self.normalized_shape, **factory))
            if bias:
                self.bias = torch.nn.Parameter(torch.zeros(self.normalized_shape, **factory))
            else:
                self.register_parameter("bias", None)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)

    def reset_parameters(self) -> None:
        if self.weight is not None:
            torch.nn.init.ones_(self.weight)
        if self.bias is not None:
            torch.nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return functional.layer_norm(x, self.normalized_shape, self.weight, self.bias,
                                     self.eps)

    # torch's own text, which changed between releases (2.13 added the bias).
    extra_repr = torch.nn.LayerNorm.extra_repr


class Linear(torch.nn.Module):
    """``torch.nn.Linear`` computed by `opforge.matmul` (and `opforge.broadcast_add` for the
    bias): same constructor, same ``weight`` ``[out, in]`` and ``bias`` parameters,
    initialisation and state_dict keys."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        factory = {"device": device, "dtype": dtype}
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, **factory))
        if bias:
            self.bias = torch.nn.Parameter(torch.empty(out_features, **factory))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # torch.nn.Linear's initialisation: Kaiming-uniform weight, uniform bias.
        torch.nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
            torch.nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = functional.matmul(x, self.weight.mT)
        # Under autocast the product is in the lower dtype; the bias joins it there (as
        # torch.nn.Linear's addmm does) instead of promoting the sum back to float32.
        return y if self.bias is None else functional.broadcast_add(y, self.bias.to(y.dtype))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}")


class _EmbeddingLookup(torch.autograd.Function):
    """Row lookup whose weight gradient is `opforge.embedding_dense_grad`. In the
    forward/setup_context form that torch.func transforms need: ``vmap`` and
    ``torch.func.grad`` work as on ``torch.nn.Embedding``."""

    generate_vmap_rule = True

    @staticmethod
    def forward(weight: torch.Tensor, indices: torch.Tensor, padding_idx: int,
                scale_grad_by_freq: bool) -> torch.Tensor:
        return torch.nn.functional.embedding(indices, weight)

    @staticmethod
    def setup_context(ctx: object, inputs: tuple[object, ...], output: torch.Tensor) -> None:
        weight, indices, padding_idx, scale_grad_by_freq = inputs
        ctx.save_for_backward(indices)
        ctx.num_weights, ctx.padding_idx = weight.shape[0], padding_idx
        ctx.scale_grad_by_freq = scale_grad_by_freq

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (indices,) = ctx.saved_tensors
        grad_weight = functional.embedding_dense_grad(
            grad.contiguous(), indices, ctx.num_weights, ctx.padding_idx,
            ctx.scale_grad_by_freq)
        return grad_weight, None, None, None


class Embedding(torch.nn.Module):
    """``torch.nn.Embedding`` (same arguments, attributes, ``from_pretrained`` and
    state_dict) whose backward is `opforge.embedding_dense_grad`: deterministic when
    torch's deterministic algorithms are on, float32 accumulation for 16-bit tables.
    ``max_norm`` and ``sparse`` are not supported (``UnsupportedError``); a ``padding_idx``
    outside ``[-num_embeddings, num_embeddings)`` is an ``AttrError``, and so is a
    ``_weight`` that is not ``(num_embeddings, embedding_dim)``."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None,
                 max_norm: float | None = None, norm_type: float = 2.0,
                 scale_grad_by_freq: bool = False, sparse: bool = False,
                 _weight: torch.Tensor | None = None, _freeze: bool = False,
                 device: torch.device | None = None, dtype: torch.dtype | None = None
                 ) -> None:
        super().__init__()
        if max_norm is not None or sparse:
            raise UnsupportedError("max_norm and sparse gradients are not supported",
                                   op="Embedding",
                                   param="sparse" if max_norm is None else "max_norm",
                                   expected="None / False",
                                   got=sparse if max_norm is None else max_norm)
        if padding_idx is not None and not -num_embeddings <= padding_idx < num_embeddings:
            raise AttrError("must index the table", op="Embedding", param="padding_idx",
                            expected=f"{-num_embeddings}..{num_embeddings - 1}",
                            got=padding_idx)
        if padding_idx is not None and padding_idx < 0:
            padding_idx += num_embeddings
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx, self.scale_grad_by_freq = padding_idx, scale_grad_by_freq
        self.max_norm, self.norm_type, self.sparse = max_norm, norm_type, sparse
        if _weight is None:
            self.weight = torch.nn.Parameter(torch.empty(num_embeddings, embedding_dim,
                                                         device=device, dtype=dtype),
                                             requires_grad=not _freeze)
            self.reset_parameters()
        else:
            if tuple(_weight.shape) != (num_embeddings, embedding_dim):
                raise AttrError("must be the table's shape", op="Embedding", param="_weight",
                                expected=(num_embeddings, embedding_dim),
                                got=tuple(_weight.shape))
            self.weight = torch.nn.Parameter(_weight, requires_grad=not _freeze)

    def reset_parameters(self) -> None:
        """N(0, 1) entries, the padding row 0 (as torch)."""
        torch.nn.init.normal_(self.weight)
        if self.padding_idx is not None:
            with torch.no_grad():
                self.weight[self.padding_idx].zero_()

    @classmethod
    def from_pretrained(cls, embeddings: torch.Tensor, freeze: bool = True,
                        padding_idx: int | None = None, max_norm: float | None = None,
                        norm_type: float = 2.0, scale_grad_by_freq: bool = False,
                        sparse: bool = False) -> Embedding:
        """A table holding ``embeddings`` (2-D, used as the parameter's data, as torch
        does), frozen unless ``freeze=False``.

        Raises:
            ShapeError: ``embeddings`` is not 2-D. UnsupportedError, AttrError: as the
                constructor.
        """
        if embeddings.dim() != 2:
            raise ShapeError("must be 2-D (num_embeddings, embedding_dim)", op="Embedding",
                             param="embeddings", expected="2 dims",
                             got=tuple(embeddings.shape))
        return cls(*embeddings.shape, padding_idx=padding_idx, max_norm=max_norm,
                   norm_type=norm_type, scale_grad_by_freq=scale_grad_by_freq, sparse=sparse,
                   _weight=embeddings, _freeze=freeze)

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        padding = -1 if self.padding_idx is None else self.padding_idx
        return _EmbeddingLookup.apply(self.weight, indices, padding, self.scale_grad_by_freq)

    def extra_repr(self) -> str:
        text = f"{self.num_embeddings}, {self.embedding_dim}"
        if self.padding_idx is not None:
            text += f", padding_idx={self.padding_idx}"
        if self.scale_grad_by_freq:
            text += ", scale_grad_by_freq=True"
        return text
