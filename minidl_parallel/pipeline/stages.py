"""Which cells, and so which parameters, belong to which pipeline stage.

A cell's stage is its ``pipeline_stage`` (MindSpore's attribute, an int >= 0, None when unset). A
*staged* cell is one with a stage whose ancestors have none: it runs whole on the ranks of its stage.
Cells inside a staged cell belong to it (a stage set on them must be the same). Cells outside every
staged cell (the network's own Cell, containers, a loss without parameters) are the glue every rank
runs. Every parameter must belong to exactly one staged cell, and every stage must have a cell:
the plan raises naming the parameter, or the stage, otherwise.
"""
from minidl.ops.primitive import Primitive

from .stage_forward import PipelineError

__all__ = ["StagePlan"]


def _stage_attr(cell):
    return getattr(cell, "pipeline_stage", None)


class StagePlan:
    """The stages of ``network`` for a pipeline of ``stages`` stages.

    Attributes:
        stages: the number of stages.
        parameters: per stage, the list of its trainable parameters (in the network's order), a shared
            one on each stage that uses it.
        stage_of_parameter: id(parameter) -> its stage (its first, when shared), for every parameter.
        shared: id(parameter) -> (parameter, its stages) for the parameters several stages use: held
            by cells of several stages, or read by an op of a later stage (found as the forward runs).
        sharded: the paths of the operators with a ``shard()`` strategy. With any, each stage's cells run
            through the tensor-parallel dispatcher over the stage's ranks (tensor parallelism inside the
            stages); without, a stage's ranks are data-parallel replicas.
    """

    def __init__(self, network, stages):
        self.stages = stages
        self._stage = {}  # id(staged cell) -> stage
        self._names = {}  # id(staged cell) -> its path in the network
        self._holders = set()  # ids of the cells without a stage that hold staged cells
        owner = {}  # id(parameter) -> (stage, path of its staged cell)
        self.parameters = [[] for _ in range(stages)]
        self.shared = {}  # id(parameter) -> (parameter, the stages that use it), for parameters of several
        self.sharded = []  # paths of the operators with a shard() strategy: the stages' cells are cut
        self._walk(network, "", None, None, owner)
        self.stage_of_parameter = {k: stage for k, (stage, _) in owner.items()}
        for name, p in network.parameters_and_names():
            if id(p) not in owner:
                raise PipelineError(f"parameter {name!r} belongs to no cell with a pipeline_stage: set "
                                    f"pipeline_stage on the cell that holds it (stages 0..{stages - 1})")
        empty = [s for s in range(stages) if s not in self._stage.values()]
        if empty:
            raise PipelineError(f"pipeline stage(s) {empty} have no cell: pipeline_stages is {stages}, so set "
                                f"pipeline_stage to each of 0..{stages - 1} on some cell of the network")

    def _walk(self, cell, path, inherited, inherited_path, owner):
        """Visits cell and its children; returns whether it is or holds a staged cell."""
        for attr, value in vars(cell).items():
            if isinstance(value, Primitive) and value.in_strategy is not None:
                self.sharded.append(f"{path}.{attr}" if path else attr)
        stage = _stage_attr(cell)
        if stage is not None:
            if stage >= self.stages:
                raise PipelineError(f"cell {path or type(cell).__name__!r} has pipeline_stage {stage}, but "
                                    f"pipeline_stages is {self.stages}: stages are 0..{self.stages - 1}")
            if inherited is not None and stage != inherited:
                raise PipelineError(f"cell {path!r} has pipeline_stage {stage} inside cell {inherited_path!r} of "
                                    f"stage {inherited}: a cell runs whole on its stage, so the cells inside it "
                                    f"take its stage")
        if inherited is None and stage is not None:
            self._stage[id(cell)] = stage
            self._names[id(cell)] = path or type(cell).__name__
            inherited, inherited_path = stage, path or type(cell).__name__
        if inherited is not None:
            for p in cell._params.values():
                if p is None:
                    continue
                where = owner.get(id(p))
                if where is not None and where[0] != inherited:
                    if not p.requires_grad:
                        raise PipelineError(f"parameter {p.name!r} is held by {where[1]!r} (stage {where[0]}) and by "
                                            f"{inherited_path!r} (stage {inherited}): only trainable parameters can "
                                            f"be shared by stages (their gradients are summed)")
                    self.share(p, where[0], inherited)
                    continue
                if where is None:
                    owner[id(p)] = (inherited, inherited_path)
                    if p.requires_grad:  # (BatchNorm's moving statistics stay with their stage, untrained)
                        self.parameters[inherited].append(p)
        staged = stage is not None
        for name, child in cell._cells.items():
            if child is not None:
                staged |= self._walk(child, f"{path}.{name}" if path else name, inherited, inherited_path, owner)
        if staged and inherited is None:
            self._holders.add(id(cell))
        return staged

    def holds_stages(self, cell):
        """Whether ``cell`` has no stage of its own but staged cells inside (a container every rank runs)."""
        return id(cell) in self._holders

    def share(self, param, owner, user):
        """Records that ``param`` of stage ``owner`` is also used on stage ``user`` (a tied embedding
        and head): each of its stages holds a copy and computes a gradient for its own uses, and the
        copies' gradients are summed (``shared``), as MindSpore's shared pipeline parameters."""
        stages = self.shared.setdefault(id(param), (param, [owner]))[1]
        if user not in stages:
            stages.append(user)
            stages.sort()
            self.parameters[user].append(param)

    def stages_of(self, param):
        """The stages that hold ``param``: its own, or every stage that shares it."""
        shared = self.shared.get(id(param))
        return list(shared[1]) if shared is not None else [self.stage_of_parameter[id(param)]]

    def stage_of_cell(self, cell):
        """The stage of a staged cell, else None."""
        return self._stage.get(id(cell))

    def describe(self, cell):
        """A staged cell's name for messages: its path and class."""
        return f"cell {self._names.get(id(cell), '?')!r} ({type(cell).__name__})"
