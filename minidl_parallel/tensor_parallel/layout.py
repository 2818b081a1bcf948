"""Layout: how one logical tensor is spread over the ranks.

A layout has three parts (MindSpore's tensor layout, with DTensor's partial placements):

- ``device_matrix``: the ranks arranged as an n-d grid, row-major, so rank
  ``= sum(coord[i] * stride[i])`` with ``stride[i]`` the product of the sizes after axis i.
  Its product is the number of devices.
- ``tensor_map``: per tensor dimension, the device-matrix axes that cut it, major first.
  ``()`` leaves the dimension whole. A dimension cut by axes (a, b) of sizes (2, 4) is in
  8 blocks; the block of a rank is ``coord[a] * 4 + coord[b]``.
- ``partial``: ``(axis, op)`` pairs: along those axes the local values are only partial
  results, and the logical tensor is their reduction (op "sum" or "max").

Axes used by neither the map nor ``partial`` hold replicas. Layouts are small, immutable and
hashable, and print short: ``(a, -) on [2, 4, 1] +sum(b)``. Axes of size 1 are dropped from
the map and from ``partial`` (they cut nothing), so equivalent layouts compare equal.

Example:
    >>> lay = Layout((2, 4), ((0,), (1,)))      # a (16, 32) tensor cut 2 x 4
    >>> lay.local_shape((16, 32))
    (8, 8)
    >>> lay.local_slices(5, (16, 32))           # rank 5 = coords (1, 1)
    (slice(8, 16, None), slice(8, 16, None))
"""
from dataclasses import dataclass
from math import prod

__all__ = ["Layout", "axis_name", "PARTIAL_OPS"]

PARTIAL_OPS = ("sum", "max")


def axis_name(axis):
    """Device-matrix axes print as letters: 0 -> a, 1 -> b, ..."""
    return chr(ord("a") + axis) if axis < 26 else f"x{axis}"


def _norm_dim(entry, who):
    if entry is None or entry == -1:
        return ()
    if isinstance(entry, int) and not isinstance(entry, bool):
        return (entry,)
    if isinstance(entry, (tuple, list)) and all(isinstance(a, int) and not isinstance(a, bool) for a in entry):
        return tuple(entry)
    raise TypeError(f"{who}: each tensor_map entry must be None, an axis or a tuple of axes, got {entry!r}")


@dataclass(frozen=True)
class Layout:
    """A distributed tensor's layout (see the module docstring).

    Args:
        device_matrix: sizes of the device grid axes (product = number of devices).
        tensor_map: one entry per tensor dimension: None / () (not cut), an axis, or a tuple
            of axes (major first).
        partial: pairs ``(axis, op)`` with op in ("sum", "max").
    """

    device_matrix: tuple
    tensor_map: tuple
    partial: tuple = ()

    def __post_init__(self):
        who = "Layout"
        dm = tuple(self.device_matrix)
        if not dm or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in dm):
            raise ValueError(f"{who}: device_matrix must be a non-empty tuple of ints >= 1, got {self.device_matrix!r}")
        tmap = tuple(_norm_dim(e, who) for e in self.tensor_map)
        part = tuple(sorted((int(a), str(op)) for a, op in self.partial))
        # Axes of size 1 cut nothing and reduce nothing: dropping them makes equal layouts equal.
        tmap = tuple(tuple(a for a in dim if not 0 <= a < len(dm) or dm[a] > 1) for dim in tmap)
        part = tuple((a, op) for a, op in part if not 0 <= a < len(dm) or dm[a] > 1)
        used = [a for dim in tmap for a in dim] + [a for a, _ in part]
        for a in used:
            if not 0 <= a < len(dm):
                raise ValueError(f"{who}: axis {a} is out of range for device_matrix {list(dm)}")
        if len(set(used)) != len(used):
            raise ValueError(f"{who}: a device axis may cut one dimension or be partial, not both or twice: "
                             f"tensor_map={tmap}, partial={part}")
        for _, op in part:
            if op not in PARTIAL_OPS:
                raise ValueError(f"{who}: partial op must be one of {PARTIAL_OPS}, got {op!r}")
        object.__setattr__(self, "device_matrix", dm)
        object.__setattr__(self, "tensor_map", tmap)
        object.__setattr__(self, "partial", part)

    # ---- constructors -------------------------------------------------------------------

    @classmethod
    def replicated(cls, ndim, device_num):
        """Every rank holds the whole tensor."""
        return cls((device_num,), ((),) * ndim)

    @classmethod
    def batch_split(cls, ndim, device_num):
        """Dimension 0 cut over all ranks (a data-parallel batch); 0-d tensors are replicated."""
        if ndim == 0:
            return cls.replicated(0, device_num)
        return cls((device_num,), ((0,),) + ((),) * (ndim - 1))

    # ---- facts --------------------------------------------------------------------------

    @property
    def ndim(self):
        return len(self.tensor_map)

    @property
    def device_num(self):
        return prod(self.device_matrix)

    def stride(self, axis):
        """How far apart in rank numbers two neighbours along ``axis`` are."""
        return prod(self.device_matrix[axis + 1:])

    def coords(self, rank):
        """The grid coordinates of ``rank``."""
        out = []
        for size in reversed(self.device_matrix):
            out.append(rank % size)
            rank //= size
        return tuple(reversed(out))

    def rank_of(self, coords):
        r = 0
        for c, size in zip(coords, self.device_matrix):
            r = r * size + c
        return r

    def cuts(self):
        """How many blocks each tensor dimension is cut into."""
        return tuple(prod(self.device_matrix[a] for a in dim) for dim in self.tensor_map)

    def partial_axes(self):
        return tuple(a for a, _ in self.partial)

    def replica_axes(self):
        """Axes of size > 1 along which every rank holds the same value."""
        used = {a for dim in self.tensor_map for a in dim} | set(self.partial_axes())
        return tuple(a for a, s in enumerate(self.device_matrix) if a not in used and s > 1)

    def is_replicated(self):
        return not self.partial and all(not dim for dim in self.tensor_map)

    def without_partial(self):
        """The same cuts with complete values (the layout of this tensor's gradient)."""
        return Layout(self.device_matrix, self.tensor_map) if self.partial else self

    # ---- shapes and blocks --------------------------------------------------------------

    def check_shape(self, shape, who="Layout"):
        """Raises ValueError unless ``shape`` has this rank and every cut divides its dimension."""
        shape = tuple(shape)
        if len(shape) != self.ndim:
            raise ValueError(f"{who}: a tensor of shape {shape} (rank {len(shape)}) cannot take layout {self} "
                             f"(rank {self.ndim})")
        for d, (n, c) in enumerate(zip(shape, self.cuts())):
            if n % c:
                raise ValueError(f"{who}: dimension {d} of shape {shape} has size {n}, not divisible by its cut {c} "
                                 f"(layout {self})")

    def local_shape(self, shape):
        """The shape of one rank's block of a tensor of global ``shape``."""
        self.check_shape(shape)
        return tuple(n // c for n, c in zip(shape, self.cuts()))

    def global_shape(self, local_shape):
        """The logical shape whose blocks have ``local_shape``."""
        if len(local_shape) != self.ndim:
            raise ValueError(f"Layout: a local block of shape {tuple(local_shape)} cannot take layout {self}")
        return tuple(n * c for n, c in zip(local_shape, self.cuts()))

    def block_index(self, rank):
        """Per tensor dimension, the index of the block ``rank`` holds (0 where not cut)."""
        coords = self.coords(rank)
        out = []
        for dim in self.tensor_map:
            i = 0
            for a in dim:
                i = i * self.device_matrix[a] + coords[a]
            out.append(i)
        return tuple(out)

    def local_slices(self, rank, shape):
        """The slices of the global tensor that ``rank``'s block covers."""
        local = self.local_shape(shape)
        return tuple(slice(i * n, (i + 1) * n) for i, n in zip(self.block_index(rank), local))

    def group(self, rank, axes):
        """The ranks that differ from ``rank`` only along ``axes``, ordered with axes major first.

        With ``axes`` the axes that cut one dimension (in the map's order), group member i
        holds block i of that dimension's part: the order collectives concatenate in.
        """
        coords = list(self.coords(rank))
        sizes = [self.device_matrix[a] for a in axes]
        ranks = []
        for i in range(prod(sizes)):
            rest = i
            for a, s in zip(reversed(axes), reversed(sizes)):
                coords[a] = rest % s
                rest //= s
            ranks.append(self.rank_of(coords))
        return tuple(ranks)

    # ---- printing -----------------------------------------------------------------------

    def __str__(self):
        dims = ", ".join("".join(axis_name(a) for a in dim) or "-" for dim in self.tensor_map)
        text = f"({dims}{',' if self.ndim == 1 else ''}) on {list(self.device_matrix)}"
        ops = {}
        for a, op in self.partial:
            ops.setdefault(op, []).append(axis_name(a))
        for op, names in ops.items():
            text += f" +{op}({''.join(names)})"
        return text

    def __repr__(self):
        return f"Layout({self})"
