"""Cell, the base of every layer and network, and the containers SequentialCell and CellList.

A Cell holds Parameters and sub-Cells as ordinary attributes; ``__setattr__`` also records
them, in assignment order, in ``_params`` and ``_cells``, so that reading ``self.weight`` in
``construct`` is a plain attribute lookup (no ``__getattr__`` on the hot path).

Parameter names (what checkpoints store) follow MindSpore and are fixed when the tree is
built: every cell remembers its path from its root (``_prefix``, e.g. ``"layer1.0."``); a
Parameter assigned with no name (or with its attribute's own name) is named prefix +
attribute, and assigning a fresh cell under a parent whose ``auto_prefix`` is True moves
the whole subtree under ``parent path + attribute name``, renaming its auto-named
parameters. So a network built bottom-up ends with full dotted names such as
``"layers.0.0.conv1.weight"``, and cells appended later (``SequentialCell.append``) are named
in place. Explicit names (different from the attribute name) are never changed. A cell or
parameter reachable through two paths (shared) keeps the name of the first one. Wrappers
that must not rename the network they hold (WithLossCell, TrainOneStepCell) pass
``auto_prefix=False``. ``parameters_and_names()`` always yields the traversal paths, as
PyTorch's ``named_parameters()`` does; without sharing they equal the names. Checkpoints key
a parameter by ``checkpoint_name``: its explicit name when it has one (MindSpore saves
``param.name``), else its path.

Cells start in inference mode (``training`` is False), as in MindSpore: call
``net.set_train()`` (or ``net.train()``) before training; ``Model.train`` does it for you.
"""
from collections import OrderedDict

from ..io.parameter_names import _AutoName, checkpoint_name  # noqa: F401  (checkpoint_name: importable here too)
from ..runtime import LOCAL, get_runtime
from ..tensor import Parameter


def _check_child_name(owner, name):
    if not isinstance(name, str) or not name:
        raise TypeError(f"{owner}: a child name must be a non-empty str, got {name!r}")
    if "." in name:
        raise ValueError(f"{owner}: child name {name!r} must not contain '.'")


class Cell:
    """Base class of layers and networks: define ``__init__`` and ``construct``.

    Args:
        auto_prefix: prefix the names of the parameters of sub-cells with their attribute
            names (True for networks; wrappers such as WithLossCell pass False so that the
            wrapped network's parameter names stay unchanged).

    Example:
        >>> class Net(nn.Cell):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.fc = nn.Dense(4, 2)
        ...     def construct(self, x):
        ...         return self.fc(x)
        >>> [p.name for p in Net().trainable_params()]
        ['fc.weight', 'fc.bias']
    """

    def __init__(self, auto_prefix=True, flags=None):
        d = self.__dict__
        d["_params"] = OrderedDict()
        d["_cells"] = OrderedDict()
        d["training"] = False
        d["_auto_prefix"] = bool(auto_prefix)
        d["_prefix"] = ""  # this cell's path from its root ("layer1.0."), as its parameters' names use
        if flags:
            d.update(flags)

    def construct(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__}: construct is not defined; a Cell subclass must "
                                  f"define construct(self, ...) to be called")

    def __call__(self, *args, **kwargs):
        runtime = get_runtime()  # a parallel runtime sees where a network starts and ends
        if runtime is LOCAL:
            return self.construct(*args, **kwargs)
        return runtime.call_cell(self, args, kwargs)  # GRAPH_MODE's layer, a parallel runtime

    # -- registration -------------------------------------------------------------------

    def _registry(self, what):
        try:
            return self.__dict__["_params"], self.__dict__["_cells"]
        except KeyError:
            raise AttributeError(f"{type(self).__name__}: Cell.__init__() was not called before assigning "
                                 f"{what}; call super().__init__() first in {type(self).__name__}.__init__")

    def __setattr__(self, name, value):
        if isinstance(value, Parameter):
            self.insert_param_to_cell(name, value, check_name_contain_dot=False)
        elif isinstance(value, Cell):
            self._insert_child(name, value)
        else:
            d = self.__dict__
            params, cells = d.get("_params"), d.get("_cells")
            if params is not None and name in params:
                if value is not None:
                    raise TypeError(f"{type(self).__name__}: cannot assign {type(value).__name__} to parameter "
                                    f"'{name}': assign a Parameter or None, or use {name}.set_data(...)")
                params[name] = None
            elif cells is not None and name in cells:
                if value is not None:
                    raise TypeError(f"{type(self).__name__}: cannot assign {type(value).__name__} to child cell "
                                    f"'{name}': assign a Cell or None")
                cells[name] = None
            object.__setattr__(self, name, value)

    def __delattr__(self, name):
        d = self.__dict__
        d.get("_params", {}).pop(name, None)
        d.get("_cells", {}).pop(name, None)
        object.__delattr__(self, name)

    def insert_param_to_cell(self, param_name, param, check_name_contain_dot=True):
        """Registers ``param`` under ``param_name`` (as ``self.<param_name> = param`` does).

        Args:
            param_name: the attribute name.
            param: a Parameter, or None to leave the slot empty.
            check_name_contain_dot: reject names containing '.'.
        """
        owner = type(self).__name__
        if check_name_contain_dot:
            _check_child_name(owner, param_name)
        if param is not None and not isinstance(param, Parameter):
            raise TypeError(f"{owner}.insert_param_to_cell: {param_name!r} must be a Parameter, "
                            f"got {type(param).__name__}")
        params, cells = self._registry(f"Parameter '{param_name}'")
        if param_name in cells:
            raise ValueError(f"{owner}: '{param_name}' is already a child cell; cannot make it a parameter")
        if param is not None and (param.name is None or
                                  (param.name == param_name and not isinstance(param.name, _AutoName))):
            param.name = _AutoName(self.__dict__["_prefix"] + param_name)
        params[param_name] = param
        object.__setattr__(self, param_name, param)

    def insert_child_to_cell(self, child_name, child_cell):
        """Registers ``child_cell`` under ``child_name`` (as ``self.<child_name> = cell`` does)."""
        owner = type(self).__name__
        _check_child_name(owner, child_name)
        if child_cell is not None and not isinstance(child_cell, Cell):
            raise TypeError(f"{owner}.insert_child_to_cell: {child_name!r} must be a Cell, "
                            f"got {type(child_cell).__name__}")
        self._insert_child(child_name, child_cell)

    def _insert_child(self, name, cell):
        params, cells = self._registry(f"Cell '{name}'")
        if name in params:
            raise ValueError(f"{type(self).__name__}: '{name}' is already a parameter; cannot make it a child cell")
        if cell is self:
            raise ValueError(f"{type(self).__name__}: a cell cannot be its own child ('{name}')")
        cells[name] = cell
        object.__setattr__(self, name, cell)
        # A cell already placed elsewhere (shared, or taken from another network) keeps the
        # names of its first placement; a fresh one moves under this cell's path.
        if cell is not None and not cell.__dict__["_prefix"]:
            cell._set_prefix(self._child_prefix(name))

    def _child_prefix(self, name):
        prefix = self.__dict__["_prefix"]
        return f"{prefix}{name}." if self.__dict__["_auto_prefix"] else prefix

    def _set_prefix(self, prefix):
        """Moves this subtree under ``prefix``, renaming the auto-named parameters it holds.

        A cell or parameter is renamed only when its current name was derived through the path
        being moved, so one reached first through another path (shared) keeps its name.
        """
        old = self.__dict__["_prefix"]
        if old == prefix:
            return
        self.__dict__["_prefix"] = prefix
        for attr, p in self._params.items():
            if p is not None and isinstance(p.name, _AutoName) and p.name == old + attr:
                p.name = _AutoName(prefix + attr)
        auto = self.__dict__["_auto_prefix"]
        for name, child in self._cells.items():
            if child is not None and child.__dict__["_prefix"] == (f"{old}{name}." if auto else old):
                child._set_prefix(self._child_prefix(name))

    # -- traversal ----------------------------------------------------------------------

    def cells_and_names(self, cells=None, name_prefix=""):
        """Yields (dotted name, cell) for this cell and every sub-cell, each once, pre-order."""
        seen = set() if cells is None else cells
        if id(self) in seen:
            return
        seen.add(id(self))
        yield name_prefix, self
        for name, cell in self._cells.items():
            if cell is not None:
                yield from cell.cells_and_names(seen, f"{name_prefix}.{name}" if name_prefix else name)

    def parameters_and_names(self, name_prefix="", expand=True):
        """Yields (dotted path, Parameter), each parameter once (first path wins).

        Args:
            name_prefix: prepended to every path.
            expand: include the parameters of sub-cells (False: this cell's own only).
        """
        seen = set()
        cells = self.cells_and_names(name_prefix=name_prefix) if expand else [(name_prefix, self)]
        for cell_name, cell in cells:
            for name, p in cell._params.items():
                if p is not None and id(p) not in seen:
                    seen.add(id(p))
                    yield (f"{cell_name}.{name}" if cell_name else name), p

    def get_parameters(self, expand=True):
        """Yields every Parameter once (trainable or not)."""
        for _, p in self.parameters_and_names(expand=expand):
            yield p

    def trainable_params(self, recurse=True):
        """The Parameters with requires_grad=True, in registration order, shared ones once."""
        return [p for p in self.get_parameters(expand=recurse) if p.requires_grad]

    def untrainable_params(self, recurse=True):
        """The Parameters with requires_grad=False (e.g. BatchNorm moving statistics)."""
        return [p for p in self.get_parameters(expand=recurse) if not p.requires_grad]

    def parameters_dict(self, recurse=True):
        """OrderedDict from parameter name (``param.name``, as checkpoints use) to Parameter."""
        return OrderedDict((p.name, p) for p in self.get_parameters(expand=recurse))

    def name_cells(self):
        """OrderedDict of the direct sub-cells by attribute name."""
        return OrderedDict((k, c) for k, c in self._cells.items() if c is not None)

    def cells(self):
        """The direct sub-cells."""
        return list(self.name_cells().values())

    # -- modes --------------------------------------------------------------------------

    def set_train(self, mode=True):
        """Sets training mode (True) or inference mode (False) on this cell and all sub-cells."""
        mode = bool(mode)
        for _, cell in self.cells_and_names():
            cell.__dict__["training"] = mode
        return self

    def zero_grad(self):
        """Clears ``.grad`` of every parameter."""
        for p in self.get_parameters():
            p.grad = None

    def apply(self, fn):
        """Calls ``fn(cell)`` on every sub-cell (children first) and on self; returns self."""
        for cell in self.cells():
            cell.apply(fn)
        fn(self)
        return self

    def recompute(self, *, use_reentrant=True, output_recompute=False, early_stop=True, context_fn=None, **kwargs):
        """Keeps only this cell's inputs in forward and runs it again in backward (MindSpore 2.10).

        The gradients, the Dropout masks, the random state after the step and the BatchNorm
        moving statistics (updated once per step) are those of the run without recompute, bit
        for bit; the price is one more forward of the cell per step (minidl/nn/recompute.py).
        The cell must return one Tensor. Calling it again replaces the settings.

        Args (keyword-only, MindSpore's; every flag a bool):
            use_reentrant: MindSpore's choice of mechanism (a custom backward, or saved-tensor
                hooks); minidl has one, which serves both.
            output_recompute: in MindSpore, the output is not kept by the ops after the cell
                either; minidl accepts it and keeps the output (it forces use_reentrant=False,
                as MindSpore).
            early_stop: MindSpore's non-reentrant recomputation stops once it has what backward
                needs; minidl accepts it and re-runs the whole cell.
            context_fn: a callable returning two context managers, entered around the forward
                and around the recomputation; only with use_reentrant=False, as MindSpore.
            **kwargs: ``mp_comm_recompute``, ``parallel_optimizer_comm_recompute``,
                ``recompute_slice_activation``: MindSpore's graph compiler's choices about
                communication operators; minidl accepts them and re-runs everything the cell
                runs, collectives included. Any other key raises ValueError, as MindSpore.

        Raises:
            TypeError: a flag that is not a bool; a context_fn that is not callable.
            ValueError: an unknown keyword; context_fn with use_reentrant=True.

        Example:
            >>> for block in net.blocks:
            ...     block.recompute()        # each block's activations live only in its backward
        """
        from .recompute import set_recompute  # (the engine and the ops, which cell.py itself never needs)
        set_recompute(self, use_reentrant=use_reentrant, output_recompute=output_recompute,
                      early_stop=early_stop, context_fn=context_fn, **kwargs)

    # -- pipeline stage -----------------------------------------------------------------

    _pipeline_stage = None  # the class default: no stage (set on an instance through the property)

    @property
    def pipeline_stage(self):
        """The pipeline stage this cell runs on (MindSpore's attribute): an int >= 0, or None (no stage).

        minidl only stores it; minidl_parallel's pipeline reads it when it runs
        (``set_auto_parallel_context(pipeline_stages=N)``): a cell of stage k runs whole on the ranks
        of stage k, with the cells inside it. Unlike MindSpore, where reading it before it was set
        raises AttributeError and None is refused, it starts as None and None may be set again.

        Example:
            >>> net.fc1.pipeline_stage, net.fc2.pipeline_stage = 0, 1
        """
        return self._pipeline_stage

    @pipeline_stage.setter
    def pipeline_stage(self, value):
        # bool is an int subclass: pipeline_stage = True is a bug, not stage 1 (MindSpore refuses it too).
        if value is not None:
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{type(self).__name__}: pipeline_stage must be an int >= 0 (or None for no "
                                f"stage), got {type(value).__name__} {value!r}")
            if value < 0:
                raise ValueError(f"{type(self).__name__}: pipeline_stage must be an int >= 0 (or None for no "
                                 f"stage), got {value}")
        self.__dict__["_pipeline_stage"] = value  # (not self._pipeline_stage = ...: that is __setattr__ again)

    # PyTorch spellings.
    def parameters(self, recurse=True):
        return self.get_parameters(expand=recurse)

    def named_parameters(self, prefix="", recurse=True):
        return self.parameters_and_names(name_prefix=prefix, expand=recurse)

    def named_children(self):
        return iter(self.name_cells().items())

    def children(self):
        return iter(self.cells())

    def named_modules(self, prefix=""):
        return self.cells_and_names(name_prefix=prefix)

    def modules(self):
        return (c for _, c in self.cells_and_names())

    def train(self, mode=True):
        return self.set_train(mode)

    def eval(self):
        return self.set_train(False)

    # -- printing -----------------------------------------------------------------------

    def extend_repr(self):
        """The text inside this cell's brackets (layers describe their configuration)."""
        return ""

    def __repr__(self):
        head = type(self).__name__
        extra = self.extend_repr()
        children = [(k, c) for k, c in self._cells.items() if c is not None]
        if not children:
            return f"{head}({extra})"
        lines = [f"{head}(" + (extra if extra else "")]
        for name, cell in children:
            body = repr(cell).replace("\n", "\n  ")
            lines.append(f"  ({name}): {body}")
        return "\n".join(lines) + "\n)"


class SequentialCell(Cell):
    """Runs its cells one after another: ``SequentialCell(a, b)(x) == b(a(x))``.

    Args:
        *args: cells, or a single list/tuple of cells, or a single OrderedDict name -> cell.

    Example:
        >>> seq = nn.SequentialCell(nn.Dense(4, 8), nn.ReLU(), nn.Dense(8, 2))
        >>> seq[0].weight.name
        '0.weight'
    """

    def __init__(self, *args):
        super().__init__()
        if len(args) == 1 and isinstance(args[0], (OrderedDict, dict)):
            for name, cell in args[0].items():
                self._check_cell(cell, name)
                self.insert_child_to_cell(name, cell)
            return
        cells = args[0] if len(args) == 1 and isinstance(args[0], (list, tuple)) else args
        for i, cell in enumerate(cells):
            self._check_cell(cell, i)
            self.insert_child_to_cell(str(i), cell)

    def _check_cell(self, cell, where):
        if not isinstance(cell, Cell):
            raise TypeError(f"{type(self).__name__}: item {where!r} must be a Cell, got {type(cell).__name__} "
                            f"(wrap operators in a Cell, e.g. nn.ReLU() rather than ops.ReLU())")

    def _list(self):
        return [c for c in self._cells.values() if c is not None]

    def __getitem__(self, index):
        cells = self._list()
        if isinstance(index, slice):
            return type(self)(cells[index])
        try:
            return cells[index]
        except IndexError:
            raise IndexError(f"{type(self).__name__}: index {index} is out of range for {len(cells)} cell(s)") from None
        except TypeError:
            raise TypeError(f"{type(self).__name__}: index must be an int or a slice, got {type(index).__name__}") from None

    def __setitem__(self, index, cell):
        self._check_cell(cell, index)
        names = [k for k, c in self._cells.items() if c is not None]
        try:
            name = names[index]
        except IndexError:
            raise IndexError(f"{type(self).__name__}: index {index} is out of range for {len(names)} cell(s)") from None
        self.insert_child_to_cell(name, cell)

    def __len__(self):
        return len(self._list())

    def __iter__(self):
        return iter(self._list())

    def append(self, cell):
        """Adds a cell at the end (named by its position); returns self."""
        self._check_cell(cell, len(self))
        self.insert_child_to_cell(str(len(self._cells)), cell)
        return self

    def construct(self, x):
        for cell in self._cells.values():
            if cell is not None:
                x = cell(x)
        return x


class CellList(Cell):
    """A list of cells whose parameters are registered (``CellList([...])[i]``).

    Unlike SequentialCell it has no construct: the owner decides how to call the cells.

    Args:
        cells: an iterable of Cells.
    """

    def __init__(self, cells=None):
        super().__init__()
        for cell in cells or ():
            self.append(cell)

    def _check_cell(self, cell, where):
        if not isinstance(cell, Cell):
            raise TypeError(f"{type(self).__name__}: item {where!r} must be a Cell, got {type(cell).__name__}")

    def __getitem__(self, index):
        cells = list(self._cells.values())
        if isinstance(index, slice):
            return CellList(cells[index])
        try:
            return cells[index]
        except IndexError:
            raise IndexError(f"CellList: index {index} is out of range for {len(cells)} cell(s)") from None

    def __setitem__(self, index, cell):
        self._check_cell(cell, index)
        names = list(self._cells)
        try:
            name = names[index]
        except IndexError:
            raise IndexError(f"CellList: index {index} is out of range for {len(names)} cell(s)") from None
        self.insert_child_to_cell(name, cell)

    def __len__(self):
        return len(self._cells)

    def __iter__(self):
        return iter(list(self._cells.values()))

    def append(self, cell):
        """Adds a cell at the end; returns self."""
        self._check_cell(cell, len(self))
        self.insert_child_to_cell(str(len(self._cells)), cell)
        return self

    def extend(self, cells):
        """Appends every cell of an iterable; returns self."""
        for cell in cells:
            self.append(cell)
        return self

    def construct(self, *args, **kwargs):
        raise NotImplementedError("CellList: it holds cells but does not define construct; "
                                  "iterate over it in the owner's construct")
