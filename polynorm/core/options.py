"""The semantics of polynorm, decided once.

Every backend receives a :class:`Plan` and the arrays already in canonical
form (2-D ``(tokens, d)`` rows, 1-D ``(d,)`` weight/bias, 1-D ``(tokens,)``
rstd).  Nothing below a backend re-derives ``k``, eps placement, casting or
the dtypes: they are all here.

The operation, for one row ``v`` of length ``d`` (see ``shared/SPEC.md``)::

    k     = floor(d * partial)                       # 1 <= k <= d; or k = partial_size
    ms    = sum(v[:k]**2) / k
    rstd  = 1 / sqrt(ms + eps)        (eps_mode="inside")
    rstd  = 1 / (sqrt(ms) + eps)      (eps_mode="outside")
    xhat  = v * rstd
    y     = xhat * (weight + offset) + bias

Casting
    ``"fp32"`` (default): every step runs in the compute dtype (float64 for
    float64 input, float32 otherwise) and rounds once, at the end, to the
    output dtype.  ``"llama"``: Hugging Face Llama's order -- ``xhat`` is
    rounded to the input dtype, ``weight + offset`` is formed in the weight
    dtype and the product is rounded to ``promote(input dtype, weight dtype)``
    (torch's ``self.weight * hidden_states.to(input_dtype)``: float32 weights
    with bfloat16 input give a float32 product); bias is added in the compute
    dtype and the result is rounded to the output dtype.  With
    ``out_dtype=promote(...)`` this is HF's ``LlamaRMSNorm`` exactly.
    ``"none"``: Liger-Kernel's ``casting_mode="none"``, every step rounded to
    the normalized input's dtype ``T`` (see :data:`NONE_CASTING`).

The backward, with ``g = weight + offset`` (1 when no weight),
``c = sum_j(g*dy*xhat)_j`` over all ``d`` columns and ``m_i = [i < k]``::

    dx      = rstd * (g*dy - m * xhat * c * alpha / k) (+ grad_residual)
    alpha   = 1                      (eps inside)
    alpha   = (s + eps) / s          (eps outside, s = sqrt(ms); term is 0 when s == 0)
    dweight = sum over tokens of dy * xhat
    dbias   = sum over tokens of dy

This is the spec's ``x * rstd**3 / k`` form rewritten with ``xhat`` so that
nothing overflows or underflows for large or tiny inputs (``rstd**3`` of a
row of 1e25 is 1e-75, below float32's range).  The casting mode does not
change the backward: it is the derivative of the exact (unrounded) function.

Non-finite rows
    The formula in IEEE arithmetic, as torch gives it, on every backend (each
    has one place for it: ``reference._rms``, ``numba.kernels._scaled_rms``,
    the CUDA ``pn_rms_*`` / ``pn_rstd_*`` helpers): an Inf among the first
    ``k`` elements makes ``ms = Inf``, ``rstd = 0`` (eps inside or outside),
    ``y = v * 0 * g + bias`` (NaN at the Inf, ``bias`` elsewhere); an Inf
    beyond ``k`` is outside the statistic; a NaN among the first ``k`` makes
    the row NaN.  The overflow-safe statistic (scaled by the row's largest
    magnitude) must not turn ``Inf / Inf`` into a NaN row.  In the backward
    ``m`` multiplies ``coef``, so the term beyond ``k`` is ``xhat * 0`` (NaN
    where xhat is not finite); with ``rstd = 0``, ``c`` is NaN and ``dx`` is
    NaN on the first ``k`` elements, ``0 * g * dy`` (+ grad_residual) beyond.
"""

from __future__ import annotations

import inspect
import math
import operator
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, ForwardRef, Literal, NamedTuple, TypeAlias, TypedDict, TypeVar

from polynorm.core.dtypes import FLOAT_DTYPES, parse_dtype

EPS_MODES = ("inside", "outside")
CASTINGS = ("fp32", "llama", "none")
NORM_INPUTS = ("h", "sum")

#: Result of a float dtype combination, by the usual promotion lattice
#: (float16 + bfloat16 -> float32, as torch and jax do).
_RANK = {"float16": 1, "bfloat16": 1, "float32": 2, "float64": 3}


def promote(a: str, b: str) -> str:
    """Float dtype name that holds both ``a`` and ``b`` exactly.

    >>> promote("bfloat16", "float32")
    'float32'
    >>> promote("float16", "bfloat16")
    'float32'
    """
    if a == b:
        return a
    ra, rb = _RANK[a], _RANK[b]
    if ra == rb:  # float16 with bfloat16: neither holds the other
        return "float32"
    return a if ra > rb else b


class Options(NamedTuple):
    """The keyword options of a call, as the caller gave them; built once per call.

    Every public function packs its keywords into one ``Options`` and passes
    it down: the front end resolves it into a :class:`Plan`
    (:func:`make_plan`), the torch custom ops carry its fields as their
    schema arguments (:data:`OPTION_TYPES`), and jax takes it, hashable, as a
    static argument.  A new option is one field here (with its type in
    ``_SharedOptions``, its schema type in :data:`OPTION_TYPES` and its text in
    :data:`OPTION_DOCS`), its resolution in :func:`make_plan` and the kernels
    that read the Plan; the public signatures take it through ``**options``.

    >>> Options(eps=1e-5).eps_mode
    'inside'
    """

    eps: Any = 1e-6
    axis: Any = -1
    partial: Any = 1.0
    partial_size: Any = None
    offset: Any = 0.0
    eps_mode: Any = "inside"
    casting: Any = "fp32"
    out_dtype: Any = None
    backend: Any = "auto"
    norm_input: Any = "h"
    residual_dtype: Any = None
    group_size: Any = None


#: Each option's type in torch's custom-op schema language (``polynorm.torch``).
OPTION_TYPES: dict[str, str] = {
    "eps": "float", "axis": "int[]", "partial": "float", "partial_size": "int?", "offset": "float",
    "eps_mode": "str", "casting": "str", "out_dtype": "str?", "backend": "str",
    "norm_input": "str", "residual_dtype": "str?", "group_size": "int?",
}
assert tuple(OPTION_TYPES) == Options._fields

#: ``new_options(Options, (eps, axis, ...))``: an :class:`Options` from its fields in
#: order, without the NamedTuple's Python ``__new__`` (a third of a microsecond, which
#: is a tenth of a small call's whole cost).
new_options = tuple.__new__

#: a dtype name (``"bfloat16"``) or a dtype object of any array library
DTypeLike: TypeAlias = Any
EpsMode: TypeAlias = Literal["inside", "outside"]
Casting: TypeAlias = Literal["fp32", "llama", "none"]
NormInput: TypeAlias = Literal["h", "sum"]


class _SharedOptions(TypedDict, total=False):
    axis: int | tuple[int, ...]
    partial: float
    partial_size: int | None
    offset: float
    eps_mode: EpsMode
    casting: Casting
    out_dtype: DTypeLike | None
    backend: str
    norm_input: NormInput
    residual_dtype: DTypeLike | None
    group_size: int | None


class NormOptions(_SharedOptions, total=False):
    """The keyword options of the array-API functions (``**options``), as typed keywords.

    A public function takes them as ``**options: Unpack[NormOptions]``, packs them
    with :func:`pack_options` and documents them through :func:`takes_options`, so a
    new option is written here (a field of :class:`Options`, its type in this dict,
    its schema type in :data:`OPTION_TYPES`, its text in :data:`OPTION_DOCS`) and in
    the semantics (:func:`make_plan`) and kernels that read it, and in no signature.
    """

    eps: float


class TorchOptions(_SharedOptions, total=False):
    """:class:`NormOptions` for :mod:`polynorm.torch`, whose ``eps=None`` means torch's default."""

    eps: float | None


#: Each option's entry in the Parameters section of a docstring (numpydoc), by field.
OPTION_DOCS: dict[str, str] = {
    "eps": "eps : float, default 1e-6\n    ``>= 0`` and finite.",
    "axis": "axis : int or tuple of int, default -1\n"
            "    The normalized axes (sorted; the slice is taken in C order).",
    "partial": "partial : float, default 1.0\n"
               "    pRMSNorm: in ``(0, 1]``; the statistic uses the first ``k = floor(d * partial)``\n"
               "    elements of a slice, and ``k`` must be at least 1.  A ``partial`` that is the\n"
               "    float nearest to ``k / d`` gives that ``k`` (``d * (15 / 22)`` is just below 15\n"
               "    in floating point: ``partial=15/22`` with ``d=22`` still gives ``k = 15``).",
    "partial_size": "partial_size : int, optional\n"
                    "    pRMSNorm by count (vLLM's ``variance_size``): ``k = partial_size``, in\n"
                    "    ``[1, d]``.  Not with ``partial`` (leave it at 1.0).",
    "offset": "offset : float, default 0.0\n"
              "    Added to ``weight`` (``offset=1.0`` is Gemma's ``1 + w``); not used without a weight.",
    "eps_mode": "eps_mode : {\"inside\", \"outside\"}, default \"inside\"\n"
                "    ``1 / sqrt(ms + eps)`` or ``1 / (sqrt(ms) + eps)``.",
    "casting": "casting : {\"fp32\", \"llama\", \"none\"}, default \"fp32\"\n"
               "    ``\"llama\"`` rounds the normalized value to ``x``'s dtype before the weight\n"
               "    multiply, as Hugging Face Llama does.  ``\"none\"`` (Liger's casting mode\n"
               "    ``\"none\"``) rounds every step to ``x``'s dtype: the squares, their mean,\n"
               "    ``rstd`` and the products; no overflow protection (float16 ``x`` beyond\n"
               "    256 overflows its square, as in Liger).  The backward is Liger's: float32\n"
               "    math with that rounded ``rstd``.",
    "out_dtype": "out_dtype : dtype or str, optional\n"
                 "    The result's dtype; defaults to the normalized input's.",
    "backend": "backend : {\"auto\", \"numba\", \"cupy\", \"dask\", \"array_api\"}, default \"auto\"\n"
               "    The backend to run on; ``\"auto\"`` picks the fastest that takes the arrays.",
    "norm_input": "norm_input : {\"h\", \"sum\"}, default \"h\"\n"
                  "    The fused add's normalized value.  ``\"h\"`` (Hugging Face, Liger): ``y`` is\n"
                  "    the norm of ``h`` as returned, rounded to its dtype.  ``\"sum\"`` (vLLM,\n"
                  "    FlashInfer, QuACK): ``y`` is the norm of the unrounded ``x + residual`` in\n"
                  "    the compute dtype; ``h`` is still rounded once for the residual output.\n"
                  "    Without a residual both are the same (the sum is ``x``); ``\"sum\"`` with\n"
                  "    ``casting=\"llama\"`` is a ``ValueError`` (llama rounds the normalized value\n"
                  "    to the input's dtype; no peer does that to an unrounded sum).",
    "residual_dtype": "residual_dtype : dtype or str, optional\n"
                      "    The dtype of ``h = x + residual`` (QuACK's ``residual_dtype``: e.g. a float32\n"
                      "    residual stream from bfloat16 inputs); default the promoted dtype of ``x`` and\n"
                      "    ``residual``.  ``y``'s default dtype stays the promoted one.  A dtype without\n"
                      "    a residual is a ``ValueError``; the backward ignores it.",
    "group_size": "group_size : int, optional\n"
                  "    Grouped RMSNorm (Mamba's ``RMSNormGated`` without a gate): each run of\n"
                  "    ``group_size`` consecutive elements of the normalized slice gets its own\n"
                  "    statistic, and ``rstd`` a trailing axis of ``d // group_size`` groups.  Must\n"
                  "    divide ``d`` (``ValueError``); with more than one group ``partial`` and\n"
                  "    ``partial_size`` must be left at their defaults (``ValueError``).",
}

_DEFAULT_OPTIONS = Options()
_DEFAULTS = _DEFAULT_OPTIONS._asdict()
_DEFAULTS_BUT_EPS = tuple(_DEFAULT_OPTIONS)[1:]
#: eps (a non-zero float) -> the Options of a call with that eps only (pack_options)
_EPS_OPTIONS: dict[float, Options] = {}
#: the Options of a call without keywords, or with a non-zero float eps only, of a function
#: that fixes some fields (pack_options' ``fixed``), by the function, eps and those fields
_FIXED_OPTIONS: dict[tuple, Options] = {}


def pack_options(func: str, options: Mapping[str, Any], **fixed: Any) -> Options:
    """The :class:`Options` of a call from its ``**options`` keywords.

    ``fixed``: fields the function sets itself (``out_dtype="float32"`` for the
    quantized output's y); a caller's keyword for one of them is a ``TypeError``,
    as is an unknown keyword (Python's own message for a bad keyword).

    >>> pack_options("rms_norm", {"eps": 1e-5}).eps
    1e-05
    >>> pack_options("rms_norm", {"epsilon": 1e-5})
    Traceback (most recent call last):
    ...
    TypeError: rms_norm() got an unexpected keyword argument 'epsilon'
    """
    if not fixed:
        if not options:
            return _DEFAULT_OPTIONS
        if len(options) == 1 and "eps" in options:
            # the usual decode call (eps only): the merge below, without the dict
            eps = options["eps"]
            if eps.__class__ is float and eps:
                # one Options object per eps value: the decode path's checks of it
                # (polynorm.ops.fast) then see the same object call after call.  Only
                # non-zero floats: equal keys are then the same eps (not -0.0 for 0.0,
                # nor True for 1.0); a NaN never matches and is not kept
                got = _EPS_OPTIONS.get(eps)
                if got is None:
                    got = new_options(Options, (eps, *_DEFAULTS_BUT_EPS))
                    if eps == eps:
                        if len(_EPS_OPTIONS) >= 64:
                            _EPS_OPTIONS.clear()
                        _EPS_OPTIONS[eps] = got
                return got
            return new_options(Options, (eps, *_DEFAULTS_BUT_EPS))
    elif not options or (len(options) == 1 and "eps" in options
                         and options["eps"].__class__ is float and options["eps"]
                         and options["eps"] == options["eps"]):
        # a function's own fields and no keyword or a non-zero float eps (rms_norm_quant's
        # usual calls): one Options object per such call, as for the others above
        key = (func, options.get("eps"), *fixed.items())
        got = _FIXED_OPTIONS.get(key)
        if got is None:
            if len(_FIXED_OPTIONS) >= 64:
                _FIXED_OPTIONS.clear()
            got = _FIXED_OPTIONS[key] = new_options(
                Options, {**_DEFAULTS, **options, **fixed}.values())
        return got
    # the defaults' order is the fields' order; an override keeps its key's place
    merged = {**_DEFAULTS, **options}
    if len(merged) != len(_DEFAULTS) or fixed:
        bad = [n for n in options if n not in _DEFAULTS or n in fixed]
        if bad:
            raise TypeError(f"{func}() got an unexpected keyword argument {bad[0]!r}")
        merged.update(fixed)
    return new_options(Options, merged.values())


F = TypeVar("F", bound=Callable[..., Any])


def _annotation(a: Any) -> Any:
    return a.__forward_arg__ if isinstance(a, ForwardRef) else a
_MARKER = re.compile(r"^( *)\{options\}\n", re.MULTILINE)


def takes_options(*, exclude: tuple[str, ...] = (), docs: Mapping[str, str] | None = None,
                  defaults: Mapping[str, Any] | None = None) -> Callable[[F], F]:
    """Decorator of a public function with ``**options``: its signature and docstring.

    The runtime signature (``help()``, IDEs, Sphinx) lists every option of
    :class:`Options` but ``exclude`` as a keyword-only parameter with its default
    (``defaults`` overrides some), in place of ``**options``; the docstring line
    ``{options}`` becomes their Parameters entries (:data:`OPTION_DOCS`, ``docs``
    overriding some).
    """

    def decorate(func: F) -> F:
        sig = inspect.signature(func)
        params = [p for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD]
        # an option the function takes as its own parameter (rms_norm_gated's
        # group_size) is documented and bound there
        names = [n for n in Options._fields if n not in exclude and n not in sig.parameters]
        given = {**_SharedOptions.__annotations__, **NormOptions.__annotations__}
        dflt = {**_DEFAULT_OPTIONS._asdict(), **(defaults or {})}
        params += [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=dflt[n],
                                     annotation=_annotation(given[n])) for n in names]
        func.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
        if func.__doc__:
            text = {**OPTION_DOCS, **(docs or {})}

            def entries(m: re.Match) -> str:
                pad = m.group(1)
                return "".join(pad + line + "\n" for n in names for line in text[n].split("\n"))

            func.__doc__, count = _MARKER.subn(entries, func.__doc__)
            assert count == 1, f"{func.__name__}: the docstring needs one {{options}} line"
        return func

    return decorate


def compute_dtype(x_dtype: str) -> str:
    """The dtype the math runs in: float64 for float64 input, else float32."""
    return "float64" if x_dtype == "float64" else "float32"


def split_dtypes(norm_dtype: str, h_dtype: str, norm_sum: bool) -> tuple[str, str]:
    """``(sum dtype, normalized dtype)`` of a fused add run apart: ``x + residual``
    is summed in the compute dtype of the inputs' promoted dtype and ``h``'s, and
    ``y`` normalizes that sum (``norm_sum``) or ``h``; ``rstd`` has the compute
    dtype of the normalized dtype.

    >>> split_dtypes("bfloat16", "bfloat16", True), split_dtypes("bfloat16", "float64", False)
    (('float32', 'float32'), ('float64', 'float64'))
    """
    sdt = compute_dtype(promote(norm_dtype, h_dtype))
    return sdt, (sdt if norm_sum else h_dtype)


@dataclass(frozen=True, slots=True)
class Plan:
    """Everything a kernel needs to know about one call, resolved and validated.

    Attributes
    ----------
    d : int
        Elements per normalized row.
    k : int
        Elements entering the statistic (pRMSNorm), ``1 <= k <= d``.
    eps : float
        Added inside or outside the square root, per ``eps_inside``.
    eps_inside : bool
        ``True`` for ``1/sqrt(ms + eps)``, ``False`` for ``1/(sqrt(ms) + eps)``.
    offset : float
        Added to the weight (Gemma's ``1 + w`` is ``offset=1.0``).  A zero
        offset is stored as ``-0.0``: ``w + (-0.0)`` is ``w`` for every ``w``,
        ``-0.0`` included, where ``-0.0 + 0.0`` would be ``+0.0``.
    llama : bool
        ``casting == "llama"``.
    norm_dtype : str
        dtype of the normalized input (``h`` for the fused add).
    compute_dtype : str
        ``"float32"`` or ``"float64"``; also the dtype of ``rstd``.
    out_dtype : str
        dtype of ``y``.
    norm_sum : bool
        ``norm_input == "sum"``: the fused add normalizes the unrounded sum.
    h_dtype : str
        dtype of the fused add's ``h`` (``residual_dtype``, default ``norm_dtype``).
        The backends' fused kernels take only the default (``norm_sum`` false,
        ``h_dtype == norm_dtype``); the front end runs any other as an add and a
        plain norm (:func:`split_add`).
    memo : dict
        Per-plan values a backend derives once (its flag words, dtype
        objects); not part of the plan's identity.
    groups : int
        ``d // group_size`` (1 without ``group_size``): the statistic is taken
        per group of ``d // groups`` consecutive elements, and ``rstd`` is
        ``(tokens, groups)`` when ``groups > 1``.  The backends never see a
        plan with ``groups > 1``: the front end runs each group as rows of
        ``group_size`` elements (``polynorm.ops.norm._grouped_forward``).
    cast_none : bool
        ``casting == "none"`` (:data:`NONE_CASTING`).
    """

    d: int
    k: int
    eps: float
    eps_inside: bool
    offset: float
    llama: bool
    norm_dtype: str
    compute_dtype: str
    out_dtype: str
    norm_sum: bool = False
    h_dtype: str = ""
    memo: dict = field(default_factory=dict, compare=False, hash=False, repr=False)
    groups: int = 1
    cast_none: bool = False

    @property
    def rstd_dtype(self) -> str:
        return self.compute_dtype


def _check_real(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        # numpy scalars are fine: they convert through float()
        try:
            import numbers

            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError
            return float(value)
        except TypeError:
            raise TypeError(
                f"{name} must be a real number, got {value!r} of type {type(value).__name__}"
            ) from None
    return float(value)


_PLANS: dict[tuple, Plan] = {}
_EXACT = (float, int)  # the scalar types a cached plan may be looked up by, unchecked


def make_plan(d: int, norm_dtype: str, opts: Options) -> Plan:
    """Validate the options and resolve them into a :class:`Plan`; cached.

    A repeated call with the same options costs one dict lookup, which keeps
    the per-call overhead of the front end small.  Options of exact Python
    types (``float``/``int``/``str``) are looked up as they are; anything
    else is checked and converted first, so that a numpy scalar counts by its
    value and a non-number (``True``, an unhashable 0-d array) is a
    ``TypeError`` naming the argument, not a cache hit or the cache's own
    "unhashable type" error.  ``opts.axis`` and ``opts.backend`` are the
    front end's business and not read here.

    >>> p = make_plan(10, "bfloat16", Options(partial=0.3))
    >>> (p.k, p.compute_dtype, p.out_dtype)
    (3, 'float32', 'bfloat16')
    >>> make_plan(22, "float32", Options(partial=15 / 22)).k   # 22 * (15/22) < 15 in floats
    15
    """
    (eps, _, partial, partial_size, offset, eps_mode, casting, out_dtype, _,
     norm_input, residual_dtype, group_size) = opts
    exact = (eps.__class__ in _EXACT and partial.__class__ in _EXACT
             and (partial_size is None or partial_size.__class__ is int)
             and offset.__class__ in _EXACT and eps_mode.__class__ is str
             and casting.__class__ is str and (out_dtype is None or out_dtype.__class__ is str)
             and norm_input.__class__ is str
             and (residual_dtype is None or residual_dtype.__class__ is str)
             and (group_size is None or group_size.__class__ is int))
    if exact:
        key = (d, norm_dtype, eps, partial, partial_size, offset, eps_mode, casting, out_dtype,
               norm_input, residual_dtype, group_size)
        plan = _PLANS.get(key)
        if plan is not None:
            return plan
    out_name = parse_dtype("out_dtype", out_dtype)
    if not isinstance(eps_mode, str):
        raise TypeError(f"eps_mode must be one of {EPS_MODES}, got {eps_mode!r}")
    if not isinstance(casting, str):
        raise TypeError(f"casting must be one of {CASTINGS}, got {casting!r}")
    if not isinstance(norm_input, str):
        raise TypeError(f"norm_input must be one of {NORM_INPUTS}, got {norm_input!r}")
    if norm_input not in NORM_INPUTS:
        raise ValueError(f"norm_input must be one of {NORM_INPUTS}, got {norm_input!r}")
    if norm_input == "sum" and casting == "llama":
        raise ValueError(
            "norm_input='sum' with casting='llama': llama casting rounds the normalized value "
            "to the input's dtype, and no peer does that to an unrounded sum; use one of them")
    if norm_input == "sum" and casting == "none":
        raise ValueError(
            "norm_input='sum' with casting='none': casting 'none' does every step in the "
            "normalized input's dtype, which the unrounded sum does not have; use one of them")
    h_name = parse_dtype("residual_dtype", residual_dtype)
    if h_name is not None and h_name not in FLOAT_DTYPES:
        raise TypeError(f"residual_dtype must be one of {FLOAT_DTYPES}, got {residual_dtype!r}")
    plan = _resolve(d, norm_dtype, eps=_check_real("eps", eps),
                    partial=_check_real("partial", partial),
                    partial_size=_check_size(partial_size),
                    offset=_check_real("offset", offset), eps_mode=eps_mode, casting=casting,
                    out_dtype=out_name, norm_sum=norm_input == "sum",
                    h_dtype=h_name or norm_dtype)
    if group_size is not None:
        plan = _grouped(plan, group_size)
    if exact:
        if len(_PLANS) >= 1024:
            _PLANS.clear()
        _PLANS[key] = plan
    return plan


def _check_size(value: Any) -> int | None:
    """``partial_size``: None or an int (numpy's too; not a bool or a float)."""
    if value is None:
        return None
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise TypeError(f"partial_size must be an int or None, got {value!r}") from None


def partial_k(d: int, partial: float) -> int:
    """``floor(d * partial)``, except that a ``partial`` which is the float nearest to
    ``c / d`` gives ``c``: ``partial = k / d`` written as a float must select ``k``,
    and ``d * fl(k / d)`` may fall just below ``k`` (``22 * (15 / 22)`` is
    ``14.999999999999998``).  Any other ``partial`` takes the exact floor of its value
    times ``d``.

    >>> partial_k(22, 15 / 22), partial_k(10, 0.35), partial_k(8, 0.1)
    (15, 3, 0)
    """
    c = round(d * partial)
    if 0 < c <= d and c / d == partial:  # Python's int / int is correctly rounded
        return c
    return math.floor(Fraction(partial) * d)


def _resolve(
    d: int,
    norm_dtype: str,
    *,
    eps: float,
    partial: float,
    partial_size: int | None = None,
    offset: float,
    eps_mode: str,
    casting: str,
    out_dtype: str | None,
    norm_sum: bool = False,
    h_dtype: str | None = None,
) -> Plan:
    if not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    if not (0.0 < partial <= 1.0):
        raise ValueError(f"partial must be in (0, 1], got {partial!r}")
    if not math.isfinite(offset):
        raise ValueError(f"offset must be finite, got {offset!r}")
    if eps_mode not in EPS_MODES:
        raise ValueError(f"eps_mode must be one of {EPS_MODES}, got {eps_mode!r}")
    if casting not in CASTINGS:
        raise ValueError(f"casting must be one of {CASTINGS}, got {casting!r}")
    if d < 1:
        raise ValueError(
            f"axis: the normalized axes have size {d}; they must hold at least one element"
        )
    if partial_size is not None:
        if partial != 1.0:
            raise ValueError(
                f"partial={partial!r} and partial_size={partial_size!r} both say how many "
                "elements enter the statistic: pass one of them")
        if not 1 <= partial_size <= d:
            raise ValueError(
                f"partial_size must be in [1, d] = [1, {d}] (d: the normalized size), "
                f"got {partial_size!r}")
        k = partial_size
    else:
        k = partial_k(d, partial)  # floor, as the pRMSNorm paper's code does
    if k < 1:
        raise ValueError(
            f"partial={partial!r} gives k = floor({d} * {partial!r}) = 0 elements; "
            f"partial must be at least 1/d = {1 / d!r}"
        )
    if out_dtype is None:
        out_dtype = norm_dtype
    elif out_dtype not in FLOAT_DTYPES:
        raise TypeError(f"out_dtype must be one of {FLOAT_DTYPES}, got {out_dtype!r}")
    return Plan(
        d=d,
        k=k,
        eps=eps,
        eps_inside=eps_mode == "inside",
        # 0.0 kept as -0.0, the additive identity: w + -0.0 is w bit for bit, so a
        # -0.0 weight keeps its sign (torch's bits) with no branch in any kernel
        offset=offset if offset != 0.0 else -0.0,
        llama=casting == "llama",
        norm_dtype=norm_dtype,
        compute_dtype=compute_dtype(norm_dtype),
        out_dtype=out_dtype,
        norm_sum=norm_sum,
        h_dtype=h_dtype or norm_dtype,
        cast_none=casting == "none",
    )


#: ``casting="none"``, Liger-Kernel's ``_CASTING_MODE_NONE``: with ``T`` the normalized
#: input's dtype, ``P = promote(T, weight dtype)``, ``T(a)`` rounding to ``T`` (each
#: operation computed in the compute dtype and rounded once, as torch does for 16-bit
#: tensors)::
#:
#:     sq   = T(x * x)
#:     ms   = T(sum(sq[:k]) / k)             # the sum in the compute dtype, fixed order
#:     rstd = T(1 / sqrt(T(ms + T(eps))))    # eps_mode="inside"
#:     rstd = T(1 / T(T(sqrt(ms)) + T(eps))) # eps_mode="outside"
#:     xhat = T(x * rstd)
#:     y    = P(xhat * P(weight + T(offset)))          # xhat without a weight
#:     y    = promote(P, bias dtype)(y + bias)        # with a bias
#:
#: then ``y`` is rounded to the output dtype; ``rstd`` is returned in the compute dtype
#: (its value is a ``T`` value: Liger stores it in ``T``).  The backward is Liger's
#: ``_rms_norm_backward_kernel`` for this mode: :class:`Plan`'s backward in the compute
#: dtype with that ``rstd``.  For float32 and float64 input every ``T(...)`` is exact
#: and this is the ``"fp32"`` arithmetic without its overflow-safe statistic.
NONE_CASTING = "none"


def _grouped(plan: Plan, group_size: Any) -> Plan:
    """``plan`` with the statistic per group of ``group_size`` (Mamba's ungated
    ``RMSNormGated``).  pRMSNorm's leading ``k`` has no per-group meaning in any peer,
    so a ``k < d`` with several groups is refused, as :func:`make_gated_plan` does."""
    import dataclasses

    gs = _group_size(group_size, plan.d)
    if gs == plan.d:
        return plan
    if plan.k != plan.d:
        raise ValueError(
            f"group_size={gs} < d={plan.d} cannot be combined with partial or partial_size "
            f"(k={plan.k}): each group's statistic takes all of its elements")
    return dataclasses.replace(plan, groups=plan.d // gs)


def _no_cast_none(plan: Plan, func: str) -> None:
    """``casting="none"`` is the plain norm's (Liger's RMSNorm); no peer gates or
    quantizes in it, and these kernels do not run it."""
    if plan.cast_none:
        raise ValueError(f"casting='none' is not available for {func}: use 'fp32' or 'llama'")


# --------------------------------------------------------------------------- gated RMSNorm


def _group_size(group_size: Any, d: int) -> int:
    """A ``group_size`` checked: an int that divides ``d``."""
    if isinstance(group_size, bool) or not hasattr(group_size, "__index__"):
        raise TypeError(f"group_size must be an int or None, got {group_size!r}")
    gs = int(group_size.__index__())
    if gs < 1 or d % gs:
        raise ValueError(f"group_size={gs} must be >= 1 and divide the normalized size d={d}")
    return gs


class _Grouped:
    """A plan whose statistic or scale is taken per group of ``group_size`` elements."""

    __slots__ = ()
    plan: Plan
    group_size: int

    @property
    def groups(self) -> int:
        return self.plan.d // self.group_size


@dataclass(frozen=True, slots=True)
class GatedPlan(_Grouped):
    """A :class:`Plan` plus the gate's options, for :func:`polynorm.rms_norm_gated`.

    The operation, per token, with ``silu(z) = z / (1 + exp(-z))`` computed in
    the compute dtype from ``z`` converted to it, and the statistic taken per
    group of ``group_size`` contiguous elements of the normalized slice (one
    group of ``d`` without ``group_size``)::

        norm_before_gate=False (Mamba-2's default):
            u    = x * silu(z)                         # compute dtype, not rounded
            rstd = 1 / sqrt(mean_group(u[:k]**2) + eps)
            y    = u * rstd * (weight + offset) + bias
        norm_before_gate=True (Qwen3-Next, Mamba's rmsnorm_fn default):
            rstd = 1 / sqrt(mean_group(x[:k]**2) + eps)
            y    = (x * rstd * (weight + offset) + bias) * silu(z)

    ``eps_mode="outside"`` places eps as in :class:`Plan`.  ``k`` is
    ``plan.k`` with one group; with several groups every element enters its
    group's statistic (``partial`` must be 1, see :func:`make_gated_plan`).

    Casting ``"fp32"`` is Mamba's ``layernorm_gated`` (x, z and weight in
    float32, one rounding at the end).  ``"llama"`` is Hugging Face's
    ``Qwen3NextRMSNormGated``: the normalized value is rounded to ``x``'s
    dtype, multiplied by ``weight + offset`` in ``weight``'s dtype (rounded to
    their promoted dtype), then (``norm_before_gate=True``) multiplied by
    ``silu(z)`` in the compute dtype; the gate product ``u`` of
    ``norm_before_gate=False`` is never rounded.

    The backward, with ``g = weight + offset``, ``s = silu(z)`` and
    ``s' = sigmoid(z) * (1 + z * (1 - sigmoid(z)))``: for
    ``norm_before_gate=False`` it is :class:`Plan`'s backward of the norm of
    ``u`` per group (``du``), then ``dx = du * s``, ``dz = du * x * s'``,
    ``dweight = sum dy * uhat``, ``dbias = sum dy``; for ``True`` it is the
    norm's backward of ``x`` with ``dy * s`` in place of ``dy``, and
    ``dz = dy * (xhat * g + bias) * s'``, ``dweight = sum dy * s * xhat``,
    ``dbias = sum dy * s``.
    """

    plan: Plan
    group_size: int
    norm_before_gate: bool

    @property
    def k(self) -> int:
        """Elements of each group entering its statistic."""
        return self.plan.k if self.groups == 1 else self.group_size


def make_gated_plan(plan: Plan, *, group_size: Any, norm_before_gate: Any) -> GatedPlan:
    """Validate the gate's options against a resolved :class:`Plan`.

    ``group_size`` must divide ``d``; ``partial < 1`` is allowed only with one
    group (pRMSNorm's leading ``k`` has no per-group meaning in Mamba, vLLM or
    FLA, so polynorm does not invent one).

    >>> p = make_plan(8, "float32", Options())
    >>> make_gated_plan(p, group_size=4, norm_before_gate=False).groups
    2
    """
    if not isinstance(norm_before_gate, (bool, int)) or norm_before_gate not in (0, 1):
        raise TypeError(f"norm_before_gate must be True or False, got {norm_before_gate!r}")
    _no_cast_none(plan, "rms_norm_gated")
    d = plan.d
    if group_size is None:
        gs = d
    else:
        gs = _group_size(group_size, d)
    if gs != d and plan.k != d:
        raise ValueError(
            f"partial={plan.k / d!r} (k={plan.k}) cannot be combined with group_size={gs} "
            f"< d={d}: use partial=1.0 with groups")
    return GatedPlan(plan=plan, group_size=gs, norm_before_gate=bool(norm_before_gate))


# --------------------------------------------------------------------------- quantized output

#: The formats :func:`polynorm.rms_norm_quant` writes, with the largest
#: magnitude a scale maps to (``qmax``) and the saturation bounds.
QUANT_DTYPES = ("float8_e4m3fn", "float8_e5m2", "int8")
_QRANGE = {"float8_e4m3fn": (448.0, -448.0, 448.0), "float8_e5m2": (57344.0, -57344.0, 57344.0),
           "int8": (127.0, -128.0, 127.0)}
#: How ``y`` meets its scale: ``"divide"`` (``y / s``, polynorm's default) or
#: ``"reciprocal"`` (``y * float32(1 / s)``: vLLM's and FlashInfer's kernels).
SCALE_MODES = ("divide", "reciprocal")
#: The smallest positive normal float32: a dynamic scale below it is replaced by 1.
SCALE_FLOOR = 2.0**-126


@dataclass(frozen=True, slots=True)
class QuantPlan(_Grouped):
    """A :class:`Plan` (``out_dtype`` float32) plus the quantization's options.

    Per token, with ``y`` the float32 result of the plan (exactly
    :func:`polynorm.rms_norm` with ``out_dtype="float32"``)::

        static (scale given):   s = float32(scale)                  one for the tensor
        dynamic, per token:     s = amax(|y|) / qmax                one per token
        dynamic, per group:     s = amax(|y[g*G:(g+1)*G]|) / qmax   one per group of G
        dynamic s < 2**-126:    s = 1     (an all-zero token or group; NaN stays NaN)
        q = encode(clip(y / s, lo, hi))                 scale_mode "divide"
        q = encode(clip(y * float32(1 / s), lo, hi))    scale_mode "reciprocal"

    ``/`` and ``*`` are float32 operations (correctly rounded), ``amax``
    propagates NaN, ``clip`` keeps NaN, and ``encode`` rounds to nearest
    even: to float8_e4m3fn (``qmax = 448``, ``[lo, hi] = [-448, 448]``; NaN
    stays NaN, its sign kept), to float8_e5m2 (``qmax = 57344``, ``[lo, hi] =
    [-57344, 57344]``; NaN stays NaN as ``ml_dtypes``' code 0x7e, its sign
    kept) or to int8 (``qmax = 127``, ``[lo, hi] = [-128, 127]``; NaN becomes 0).
    """

    plan: Plan
    qdtype: str
    static: bool
    scale: float | None  # the static scale as a float32 value, None for an array scale
    group_size: int
    scale_mode: str = "divide"

    @property
    def reciprocal(self) -> bool:
        return self.scale_mode == "reciprocal"

    @property
    def qmax(self) -> float:
        return _QRANGE[self.qdtype][0]

    @property
    def lo(self) -> float:
        return _QRANGE[self.qdtype][1]

    @property
    def hi(self) -> float:
        return _QRANGE[self.qdtype][2]


def parse_quant_dtype(dtype: Any) -> str:
    """``"float8_e4m3fn"``, ``"float8_e5m2"`` or ``"int8"`` from a name or any library's dtype object.

    >>> import numpy as np
    >>> parse_quant_dtype(np.int8), parse_quant_dtype("float8_e4m3fn")
    ('int8', 'float8_e4m3fn')
    """
    if isinstance(dtype, str):
        name = dtype
    else:
        try:
            import numpy as np

            name = np.dtype(dtype).name
        except TypeError:
            name = str(getattr(dtype, "name", dtype))
        name = name.rsplit(".", 1)[-1].lower()
    if name not in QUANT_DTYPES:
        raise TypeError(f"dtype must be one of {QUANT_DTYPES}, got {dtype!r}")
    return name


def make_quant_plan(plan: Plan, *, qdtype: str, scale: Any, scale_is_array: bool,
                    group_size: Any, scale_mode: Any = "divide") -> QuantPlan:
    """Validate the quantization's options against a resolved :class:`Plan`.

    ``scale`` (a real number, when not an array) must be positive and finite
    as a float32; ``group_size`` (dynamic scales only) must divide ``d``;
    ``scale_mode`` is one of :data:`SCALE_MODES`.

    >>> p = make_plan(8, "float32", Options(out_dtype="float32"))
    >>> make_quant_plan(p, qdtype="int8", scale=None, scale_is_array=False, group_size=4).groups
    2
    """
    _no_cast_none(plan, "rms_norm_quant")
    d = plan.d
    if not (isinstance(scale_mode, str) and scale_mode in SCALE_MODES):
        raise ValueError(f"scale_mode must be one of {SCALE_MODES}, got {scale_mode!r}")
    static = scale is not None or scale_is_array
    value = None
    if scale is not None:
        value = _check_real("scale", scale)
        import numpy as np

        with np.errstate(over="ignore", under="ignore"):
            v32 = float(np.float32(value))
        if not (math.isfinite(v32) and v32 > 0):
            raise ValueError(
                f"scale must be a positive finite float32 value, got {scale!r}"
                + (f" (float32: {v32!r})" if v32 != value else ""))
        value = v32
    if group_size is None:
        gs = d
    else:
        if static:
            raise ValueError(
                "group_size is for dynamic scales: pass scale=None with group_size, "
                f"or group_size=None with a static scale (got group_size={group_size!r})")
        gs = _group_size(group_size, d)
    return QuantPlan(plan=plan, qdtype=qdtype, static=static, scale=value, group_size=gs,
                     scale_mode=scale_mode)
