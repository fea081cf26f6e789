"""Portability lint over the operator modules: no API the Triton portability rules ban, and
every module in the common order (OpDef, reference, kernels, launcher, backward)."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest

import opforge.ops

OPS_DIR = Path(opforge.ops.__file__).parent
MODULES = sorted(OPS_DIR.glob("*.py"))
# Dotted names in code (comments and strings excluded) and why each is banned.
BANNED = {
    r"(^|\.)libdevice(\.|$)": "libdevice is missing on triton-ascend and in the interpreter",
    r"(^|\.)inline_asm_elementwise$": "inline assembly is not portable",
    r"(^|\.)extern_elementwise$": "extern calls are not portable",
    r"^tl\.topk$": "tl.topk is absent from triton 3.2 (triton-ascend)",
    r"^tl\.sort$": "tl.sort is not portable for integer keys",
    r"^tl\.(math\.)?(erf|erfc|tanh)$": "write erf/tanh from primitives",
    r"^(num_warps|num_stages)$": "GPU-only launch options do not belong in portable kernels",
}


def dotted_names(source: str) -> list[tuple[int, str]]:
    """(line, dotted name) of every ``a.b.c`` chain of NAME tokens in the code."""
    names: list[tuple[int, str]] = []
    chain: list[str] = []
    line = 0
    expect_name = True
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.NAME and expect_name:
            chain.append(token.string)
            line = line or token.start[0]
            expect_name = False
        elif token.type == tokenize.OP and token.string == "." and chain:
            expect_name = True
        else:
            if chain:
                names.append((line, ".".join(chain)))
            chain, line, expect_name = [], 0, True
            if token.type == tokenize.NAME:
                chain, line, expect_name = [token.string], token.start[0], False
    return names


def test_lint_finds_banned_names():
    names = [name for _, name in dotted_names("import x\ny = tl.math.erf(x)  # tl.sort\n"
                                              "s = 'libdevice'\nk[g](num_warps=4)\n")]
    assert "tl.math.erf" in names and "num_warps" in names
    assert "tl.sort" not in names and "libdevice" not in names


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_no_banned_triton_apis(path):
    for line, name in dotted_names(path.read_text()):
        for pattern, why in BANNED.items():
            assert re.search(pattern, name) is None, f"{path.name}:{line}: {name}: {why}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_storage_dtypes_convert_through_the_exact_helpers(path):
    """Every tl.load is widened to float32 at once by `widen` (bf16 arithmetic fails in the
    interpreter, whose bf16 casts also mangle subnormals) and every tl.store rounds through
    `rounded_for` (the interpreter's bf16 cast truncates); workspace partials are float32
    and exempt, and so are float32 row statistics (marked "float32 statistic"), integer
    indices (marked "integer index"), boolean masks (marked "boolean mask": compared with
    0, never computed with) and
    tensor-core operands compiled kernels keep in 16 bits (marked "dot operand"; under the
    interpreter they are widened)."""
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if any(mark in line for mark in ("partial", "dot operand", "float32 statistic",
                                         "integer index", "boolean mask")):
            continue
        if "tl.load(" in line:
            assert "widen(tl.load(" in line, f"{path.name}:{number}: {line.strip()}"
        if "tl.store(" in line:
            assert "rounded_for(" in line, f"{path.name}:{number}: {line.strip()}"


@pytest.mark.parametrize("path", [p for p in MODULES if not p.name.startswith("_")],
                         ids=lambda p: p.name)
def test_operator_module_order(path):
    source = path.read_text()
    generated = re.search(r"^[A-Z_]+, [A-Z_]+ = (pointwise|gated|gated_product)\(", source,
                          re.MULTILINE)
    if generated:  # an operator made from its math: kernels, then the generator's call
        kernels = source.find("@triton.jit")
        assert 0 <= kernels < generated.start() or "from opforge.ops." in source
        return
    opdef = re.search(r"^[A-Z_]+ = (OpDef|elementwise_op|_\w*opdef)\(", source, re.MULTILINE)
    reference = re.search(r"\.reference(\n|\()", source)
    markers = ["@triton.jit", '.launcher("triton")', ".autograd(", "register_op("]
    positions = [opdef.start() if opdef else -1, reference.start() if reference else -1]
    positions += [source.find(m) for m in markers]
    # Kernels defined with `_math.jit` (no import guard) count as `@triton.jit` ones.
    positions[2] = min((p for p in (positions[2], source.find("\n@jit\n")) if p >= 0),
                       default=-1)
    markers = ["OpDef", "reference", *markers]
    optional = set()
    if "from opforge.ops import _" in source or re.search(r"\b\w+\._\w+_kernel\[", source):
        # Kernels shared with other operators, in ops/_*.py or another operator's module.
        optional.add("@triton.jit")
    if "run_step(" in source and "@triton.jit" not in source and "\n@jit\n" not in source:
        optional.add("@triton.jit")  # a composite: its steps' operators hold the kernels
    if "Forward only" in source:
        optional.add(".autograd(")  # an inference operator has no backward
    kept = [(m, p) for m, p in zip(markers, positions, strict=True)
            if not (m in optional and p < 0)]
    markers, positions = [m for m, _ in kept], [p for _, p in kept]
    assert all(p >= 0 for p in positions), dict(zip(markers, positions, strict=True))
    assert positions == sorted(positions), "order: OpDef, reference, kernels, launcher, " \
                                           "backward, registration"
