"""What the code around a call site says: the branches and loops a collective is issued under.

A recorded call site carries a short stack of the job's own frames (``file:line function``,
innermost first). Reading those files (when they are still where the job ran them) and walking the
syntax tree down to each line gives the statements that enclose the call: ``if`` tests, loops,
``with`` blocks. Two facts follow from structure, not from what anything is called:

- a collective issued under an ``if`` whose test reads the process's rank (``dist.get_rank()``,
  ``self.rank == 0``, ``is_main_process``, ``LOCAL_RANK``) is issued by a subset of the ranks;
- a collective issued inside the same loop body as a ``backward()`` call runs once per iteration of
  that loop (a micro-batch loop), not once per step.

Source that cannot be read (another host, a deleted file, a syntax error, too large) gives no facts:
callers treat "unknown" as no evidence either way. Nothing here imports torch or executes the code.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

#: Files larger than this are not parsed (bounded analysis).
MAX_SOURCE_BYTES = 2 * 1024 * 1024
#: How a branch test reads the process's own rank: the rank APIs of torch, Lightning, accelerate,
#: DeepSpeed and the environment variables torchrun sets.
_RANK_TEST = re.compile(
    r"\b(get_rank|get_global_rank|get_local_rank|rank|local_rank|global_rank|node_rank|process_index|"
    r"local_process_index|is_main_process|is_local_main_process|is_main|is_master|is_global_zero|"
    r"is_rank_zero|rank_zero|is_first_rank|is_last_rank|is_first_stage|is_last_stage|RANK|LOCAL_RANK|"
    r"get_coordinate|coordinate)\b"
)
#: Statements that leave the block's loop or function.
_EXITS = (ast.Return, ast.Continue, ast.Break, ast.Raise)
_RANK_DECORATOR = re.compile(r"\b(rank_zero_only|main_process_only|on_main_process|on_rank_0|rank0_only)\b")


@dataclass(frozen=True)
class Enclosing:
    """A statement that encloses a call: ``if`` / ``elif`` (with its test), ``for`` / ``while``,
    ``with``, ``def`` (with its decorators)."""

    kind: str  # "if", "for", "while", "with", "def", "try"
    file: str
    line: int
    text: str  # the test, the loop header, the decorators; one line, at most 160 characters

    @property
    def short(self) -> str:
        return f"{self.file.rsplit('/', 1)[-1]}:{self.line}"


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    function: str

    @property
    def short(self) -> str:
        return f"{self.file.rsplit('/', 1)[-1]}:{self.line}"


def parse_frame(text: str) -> Frame | None:
    """``"/path/train.py:60 main"`` (the recorder's stack entry) -> ``Frame``."""
    where, _, function = text.partition(" ")
    path, _, line = where.rpartition(":")
    if not path or not line.isdigit():
        return None
    return Frame(path, int(line), function)


@lru_cache(maxsize=64)
def _source(path: str) -> tuple[ast.Module, list[str]] | None:
    """The file's syntax tree and lines, read once (None when unreadable, too large or not Python)."""
    try:
        p = Path(path)
        if not p.is_file() or p.stat().st_size > MAX_SOURCE_BYTES:
            return None
        text = p.read_text(errors="replace")
        return ast.parse(text, filename=path), text.splitlines()
    except (OSError, SyntaxError, ValueError, RecursionError, MemoryError):
        return None


def _tree(path: str) -> ast.Module | None:
    source = _source(path)
    return None if source is None else source[0]


def _segment(node: ast.AST) -> str:
    try:
        text = ast.unparse(node)
    except Exception:  # noqa: BLE001 - unparse of odd trees; the text is only shown
        text = type(node).__name__
    text = " ".join(text.split())
    return text if len(text) <= 160 else text[:157] + "..."


def _header(node: ast.AST) -> tuple[str, str] | None:
    if isinstance(node, ast.If):
        return "if", _segment(node.test)
    if isinstance(node, (ast.For, ast.AsyncFor)):
        return "for", f"for {_segment(node.target)} in {_segment(node.iter)}"
    if isinstance(node, ast.While):
        return "while", f"while {_segment(node.test)}"
    if isinstance(node, (ast.With, ast.AsyncWith)):
        return "with", "with " + ", ".join(_segment(i.context_expr) for i in node.items)
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return "def", " ".join(f"@{_segment(d)}" for d in node.decorator_list) + f" def {node.name}"
    if isinstance(node, ast.Try):
        return "try", "try"
    return None


def _body_of(node: ast.stmt, line: int) -> bool:
    """Is ``line`` inside the part of ``node`` that is conditional on it (an ``if``'s branches,
    not its test; a loop's body)?"""
    if isinstance(node, ast.If):
        return node.test.end_lineno < line <= (node.end_lineno or 0)
    return node.lineno <= line <= (node.end_lineno or 0)


@lru_cache(maxsize=512)
def enclosing(path: str, line: int) -> tuple[Enclosing, ...]:
    """The statements enclosing ``line`` in ``path``, outermost first (empty when unreadable)."""
    tree = _tree(path)
    if tree is None:
        return ()
    chain: list[Enclosing] = []
    body: list[ast.stmt] = list(tree.body)
    while body:
        inner: ast.stmt | None = None
        for node in body:
            if node.lineno <= line <= (node.end_lineno or node.lineno):
                inner = node
                break
        if inner is None:
            break
        head = _header(inner)
        if head is not None and _body_of(inner, line):
            chain.append(Enclosing(head[0], path, inner.lineno, head[1]))
        body = [n for n in ast.iter_child_nodes(inner) if isinstance(n, ast.stmt)]
    return tuple(chain)


def _assigned(path: str, name: str, before: int) -> list[str]:
    """The right-hand sides of every ``name = ...`` before line ``before`` in ``path``'s innermost
    function around it (one step of data flow: ``should_log = rank == 0`` then ``if should_log:``;
    all of them, since a later one may sit in a branch that did not run)."""
    tree = _tree(path)
    if tree is None:
        return []
    scope: ast.AST = tree
    for node in ast.walk(tree):
        if (
            isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.lineno <= before <= (node.end_lineno or 0)
            and node.lineno >= getattr(scope, "lineno", 0)
        ):
            scope = node
    found = []
    for node in ast.walk(scope):
        if (
            isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign))
            and node.lineno < before
            and node.value is not None
        ):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                found.append(_segment(node.value))
    return found


def _operand_names(node: ast.AST) -> set[str]:
    """Names the test's truth is made of (``a``, ``not a``, ``a and b``, ``a == 0``), not the
    arguments of a call inside it (a call decides by its own code)."""
    if isinstance(node, ast.Name):
        return {node.id}
    if isinstance(node, ast.UnaryOp):
        return _operand_names(node.operand)
    if isinstance(node, ast.BoolOp):
        return set().union(*(_operand_names(v) for v in node.values))
    if isinstance(node, ast.Compare):
        return set().union(_operand_names(node.left), *(_operand_names(c) for c in node.comparators))
    if isinstance(node, ast.Call) and not node.keywords:
        # A conversion keeps its operand's value: `flag.item()`, `t.any()`, `float(x)`, `bool(x)`.
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr in _VALUE_METHODS and not node.args:
            return _operand_names(f.value)
        if isinstance(f, ast.Name) and f.id in _CONVERSIONS and len(node.args) == 1:
            return _operand_names(node.args[0])
    return set()


_VALUE_METHODS = frozenset({"item", "any", "all", "bool", "float", "int"})
_CONVERSIONS = frozenset({"bool", "float", "int"})


def _reads_rank(enc: Enclosing) -> bool:
    if _RANK_TEST.search(enc.text):
        return True
    tree = _tree(enc.file)
    if tree is None:
        return False
    try:
        names = _operand_names(ast.parse(enc.text, mode="eval").body)
    except SyntaxError:
        return False
    return any(_rank_valued(rhs) for name in sorted(names) for rhs in _assigned(enc.file, name, enc.line))


#: Calls that only convert or wrap their argument: ``bool(rank == 0)`` is still the rank's test.
_WRAPPERS = frozenset({"bool", "int", "float", "tensor", "as_tensor", "Tensor", "all", "any", "item"})


def _rank_valued(rhs: str) -> bool:
    """Whether an assigned value is a test on the rank. A value a call computes (``finite =
    scaler.unscale_and_check(opt, inject=rank == 1)``) is the call's result, read from data: a rank
    among the call's arguments only parameterises it; the called name itself may read the rank
    (``accelerator.is_main_process()``), and a conversion (``bool(rank == 0)``) is still the test."""
    try:
        node = ast.parse(rhs.strip(), mode="eval").body
    except SyntaxError:
        return bool(_RANK_TEST.search(rhs))
    if isinstance(node, ast.Call):
        func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        if func not in _WRAPPERS:
            return bool(_RANK_TEST.search(ast.unparse(node.func)))
    return bool(_RANK_TEST.search(rhs))


def frames(stack: tuple[str, ...]) -> list[Frame]:
    return [f for f in map(parse_frame, stack) if f is not None]


def rank_guard(stack: tuple[str, ...]) -> Enclosing | None:
    """The branch on the rank a collective is issued under: an enclosing ``if`` whose test reads the
    rank (or a function decorated to run on one rank only) in any frame of the call's stack; an early
    ``return`` / ``continue`` on the rank before the call in its function; or, for a hook or callback
    that torch called (its caller is not on the stack), the rank branch around the code that created
    or registered it."""
    fs = frames(stack)
    for i, frame in enumerate(fs):
        for enc in reversed(enclosing(frame.file, frame.line)):
            if enc.kind == "if" and _reads_rank(enc):
                return enc
            if enc.kind == "def" and _RANK_DECORATOR.search(enc.text):
                return enc
        early = _early_exit(frame) or _left_loop(frame)
        if early is not None:
            return early
        caller = fs[i + 1] if i + 1 < len(fs) else None
        if caller is None or frame.function not in (line_text(caller.file, caller.line) or ""):
            registered = _registered_under_guard(frame, {f.function for f in fs[i + 1 :]})
            if registered is not None:
                return registered
    return None


def _function_at(path: str, line: int) -> list[ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef]:
    """The ``def`` / ``class`` statements enclosing ``line``, outermost first."""
    tree = _tree(path)
    if tree is None:
        return []
    return sorted(
        (
            n
            for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and n.lineno <= line <= (n.end_lineno or 0)
        ),
        key=lambda n: n.lineno,
    )


def qualified_function(path: str, line: int, name: str) -> str | None:
    """The name a fix can patch for the function ``name`` running ``line`` of ``path``: ``name`` at
    module level, ``Class.name`` for a method (classes nested in classes too); None for a function
    defined inside another (a new object each call: nothing to patch) or a source that cannot be read."""
    enclosing = _function_at(path, line)
    if not enclosing or enclosing[-1].name != name or isinstance(enclosing[-1], ast.ClassDef):
        return None
    if any(not isinstance(n, ast.ClassDef) for n in enclosing[:-1]):
        return None
    return ".".join(n.name for n in enclosing)


def defined_classes(path: str) -> set[str] | None:
    """Names of the classes ``path`` defines (None when the source cannot be read)."""
    tree = _tree(path)
    if tree is None:
        return None
    return {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}


def _early_exit(frame: Frame) -> Enclosing | None:
    """``if not is_main: return`` before ``frame.line`` in the function around it."""
    defs = [n for n in _function_at(frame.file, frame.line) if not isinstance(n, ast.ClassDef)]
    if not defs:
        return None
    for node in ast.walk(defs[-1]):
        if (
            isinstance(node, ast.If)
            and (node.end_lineno or 0) < frame.line
            and all(isinstance(b, _EXITS) for b in node.body)
        ):
            test = Enclosing("if", frame.file, node.lineno, _segment(node.test))
            if _reads_rank(test):
                return Enclosing("if", frame.file, node.lineno, test.text + " (early exit)")
    return None


def _left_loop(frame: Frame) -> Enclosing | None:
    """``for ...: if stop: break`` ended before ``frame.line`` in the function around it, with a test
    that reads the rank (``stop = rank == 0 and STOP.exists()``): the ranks that took the ``break``
    reached the call while the others are still in the loop."""
    defs = [n for n in _function_at(frame.file, frame.line) if not isinstance(n, ast.ClassDef)]
    if not defs:
        return None
    for loop in ast.walk(defs[-1]):
        if not isinstance(loop, (ast.For, ast.While)) or (loop.end_lineno or 0) >= frame.line:
            continue
        inner_loops = [n for n in ast.walk(loop) if isinstance(n, (ast.For, ast.While)) and n is not loop]
        for node in ast.walk(loop):
            if (
                isinstance(node, ast.If)
                and any(isinstance(b, ast.Break) for b in node.body)
                and not any(n.lineno <= node.lineno <= (n.end_lineno or 0) for n in inner_loops)
            ):
                test = Enclosing("if", frame.file, node.lineno, _segment(node.test))
                if _reads_rank(test):
                    return Enclosing(
                        "if", frame.file, node.lineno, f"{test.text} (leaves the loop of line {loop.lineno})"
                    )
    return None


def _registered_under_guard(frame: Frame, on_stack: set[str]) -> Enclosing | None:
    """A hook or callback (called by torch or a framework, not by a frame on the stack): the code
    that references its function, an enclosing function or its class, under a rank branch. Functions
    on the stack (``main``) are the ordinary call path, not a registration: their names are not
    looked up."""
    tree = _tree(frame.file)
    if tree is None:
        return None
    names = {n.name for n in _function_at(frame.file, frame.line)} - on_stack
    if not names:
        return None
    for node in ast.walk(tree):
        ref = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
        if ref not in names or not hasattr(node, "lineno"):
            continue
        for enc in reversed(enclosing(frame.file, node.lineno)):
            if enc.kind == "if" and _reads_rank(enc):
                return Enclosing("if", enc.file, enc.line, f"{enc.text} (around {ref} at line {node.lineno})")
    return None


def line_text(path: str, line: int) -> str | None:
    source = _source(path)
    if source is None:
        return None
    lines = source[1]
    return lines[line - 1].strip() if 0 < line <= len(lines) else None


def loops_around(path: str, line: int) -> list[Enclosing]:
    """The ``for`` and ``while`` statements enclosing ``line``, outermost first."""
    return [e for e in enclosing(path, line) if e.kind in ("for", "while")]


def fixed_trip_count(loop: Enclosing) -> int | None:
    """The iterations of a ``for X in range(N)`` loop whose ``N`` is an integer literal, or a name that
    every assignment before the loop (in its function, else at the module's top level) sets to the
    same integer literal: the same on every rank. None for any other loop (data, arguments, lengths)."""
    if loop.kind != "for":
        return None
    try:
        node = ast.parse(loop.text + ": pass").body[0]
    except SyntaxError:
        return None
    it = getattr(node, "iter", None)
    if not (isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "range"):
        return None
    if len(it.args) != 1 or it.keywords:
        return None
    arg = it.args[0]
    if isinstance(arg, ast.Name):
        values = _assigned(loop.file, arg.id, loop.line) or _module_assigned(loop.file, arg.id)
        if not values or len(set(values)) != 1:
            return None
        try:
            arg = ast.parse(values[0], mode="eval").body
        except SyntaxError:
            return None
    if isinstance(arg, ast.Constant) and type(arg.value) is int:
        return arg.value
    return None


def _module_assigned(path: str, name: str) -> list[str]:
    """The right-hand sides of the module's top-level ``name = ...`` statements."""
    tree = _tree(path)
    if tree is None:
        return []
    return [
        _segment(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
    ]


def calls_in(path: str, node_line: int, attribute: str) -> list[int]:
    """Lines inside the statement starting at ``node_line`` that call ``.attribute(...)`` or
    ``attribute(...)``."""
    tree = _tree(path)
    if tree is None:
        return []
    for node in ast.walk(tree):
        if isinstance(node, ast.stmt) and node.lineno == node_line:
            found = []
            for sub in ast.walk(node):
                if isinstance(sub, ast.Call):
                    f = sub.func
                    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
                    if name == attribute:
                        found.append(sub.lineno)
            return sorted(found)
    return []


def on_the_way(there: tuple[str, ...], here: tuple[str, ...]) -> tuple[Frame, Frame, Enclosing] | None:
    """Whether a rank whose stack is ``here`` will reach the call whose stack is ``there`` later in the
    same pass of a loop: a frame of each in the same function of the same file, ``here``'s at an
    earlier line, both inside the same innermost loop, and no ``break`` / ``continue`` / ``return`` /
    ``raise`` on the lines between. Returns (the frame of ``here``, the frame of ``there``, the loop)."""
    for ahead in frames(there):
        for behind in frames(here):
            if (ahead.file, ahead.function) != (behind.file, behind.function) or behind.line >= ahead.line:
                continue
            loops, theirs = loops_around(ahead.file, ahead.line), loops_around(behind.file, behind.line)
            if not loops or not theirs or loops[-1] != theirs[-1]:
                continue
            tree = _tree(ahead.file)
            if tree is None or any(
                isinstance(n, _EXITS) and behind.line < n.lineno < ahead.line for n in ast.walk(tree)
            ):
                continue
            return behind, ahead, loops[-1]
    return None


def shared_loop(stack: tuple[str, ...], attribute: str = "backward") -> Enclosing | None:
    """The innermost loop, in any frame of the call's stack, whose body also calls ``attribute``
    (``backward``): the collective runs once per iteration of the loop that runs the backward
    passes (a micro-batch loop)."""
    for frame in frames(stack):
        for enc in reversed(enclosing(frame.file, frame.line)):
            if enc.kind in ("for", "while") and calls_in(frame.file, enc.line, attribute):
                return enc
    return None


def same_loop(inside: tuple[str, ...], again: tuple[str, ...]) -> Enclosing | None:
    """The micro-batch loop (``shared_loop``) that encloses both calls, when it is the same loop
    statement in both stacks: a rank whose collective ``inside`` is issued there has not left the
    loop that the rank issuing ``again`` is going round once more (an extra collective within an
    iteration, not fewer iterations). Only a loop nested in another one and that steps no optimizer
    (not the training-step loop, which encloses the step's closing collectives as well)."""
    mine, theirs = shared_loop(inside), shared_loop(again)
    if mine is None or theirs is None or (mine.file, mine.line) != (theirs.file, theirs.line):
        return None
    if calls_in(mine.file, mine.line, "step") or not _nested(inside, mine):
        return None  # the training-step loop: the optimizer's collectives are inside it too
    return mine


def _nested(stack: tuple[str, ...], loop: Enclosing) -> bool:
    """Whether another loop encloses ``loop`` (in its frame or a caller's): a loop inside the
    training-step loop, not the training-step loop itself."""
    seen = False
    for frame in frames(stack):
        encs = enclosing(frame.file, frame.line)
        keys = [(e.file, e.line) for e in encs]
        if not seen and (loop.file, loop.line) in keys:
            seen = True
            encs = encs[: keys.index((loop.file, loop.line))]
        elif not seen:
            continue
        if any(e.kind in ("for", "while") for e in encs):
            return True
    return False


@dataclass(frozen=True)
class Branch:
    """The ``if`` whose outcome decides whether a call runs: the call is in its body (``runs_when``
    True), in its ``else`` (False), or after it when its body leaves (``continue`` / ``return`` /
    ``break`` / ``raise``: False)."""

    file: str
    line: int
    test: str
    runs_when: bool

    @property
    def short(self) -> str:
        return f"{self.file.rsplit('/', 1)[-1]}:{self.line}"


def decision_branch(
    stack: tuple[str, ...], others: tuple[tuple[str, ...], ...] = (), *, confirmed: bool = False
) -> Branch | None:
    """The branch that sent this call's rank one way and the ``others`` (stacks of ranks that did
    not issue it) another: an ``if`` around the call line (its body or its ``else``), or an earlier
    ``if`` in the same function whose body leaves it, such that every other rank that is in the same
    function is not on the call's side of it. A branch the other ranks' stacks confirm wins over one
    they cannot see (not in that function), the innermost frame first. Tests that read the rank are
    not decisions a rank makes from its data (``rank_guard`` covers them); tests on an attribute alone
    (``if self.collective:``, ``if args.apply_fix:``) are settings, the same on every rank, and are
    passed over too, as are schedules on a loop's counter (``if (step + 1) % cfg.sync_every == 0:``).
    With ``confirmed``, only a branch the other ranks' stacks confirm."""
    theirs = [frames(o) for o in others]
    unconfirmed: Branch | None = None
    for frame in frames(stack):
        defs = [n for n in _function_at(frame.file, frame.line) if not isinstance(n, ast.ClassDef)]
        scope: ast.AST | None = defs[-1] if defs else None
        if scope is None and frame.function == "<module>":
            scope = _tree(frame.file)  # a training loop written at the script's top level
        if scope is None:
            continue
        lines = [f.line for fs in theirs for f in fs if f.file == frame.file and f.function == frame.function]
        candidates = []
        for node in ast.walk(scope) if defs else _own_nodes(scope):
            if not isinstance(node, ast.If) or _configuration(node.test) or _schedule(node, scope):
                continue
            side = _side(node, frame.line)
            if side == "after" and not (_leaves(node.body) and not node.orelse):
                continue
            if side not in ("body", "else", "after"):
                continue
            test = Enclosing("if", frame.file, node.lineno, _segment(node.test))
            if _reads_rank(test):
                continue
            candidates.append((node, side, Branch(frame.file, node.lineno, test.text, side == "body")))
        for node, side, branch in sorted(candidates, key=lambda c: -c[0].lineno):
            end = _loop_end(scope, node) if side == "after" else None
            if lines and all(_side(node, line) != side or (end is not None and line > end) for line in lines):
                return branch
            if not lines and unconfirmed is None:
                unconfirmed = branch
    return None if confirmed else unconfirmed


def _own_nodes(scope: ast.AST):
    """The nodes of a function, or of a module's top level, without those of the functions and
    classes defined inside it (their code runs elsewhere)."""
    todo = list(ast.iter_child_nodes(scope))
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        yield node
        todo.extend(ast.iter_child_nodes(node))


def collection_decision(stack: tuple[str, ...]) -> Branch | None:
    """When the call runs once per item of a collection the job filled earlier (``for name, s in
    self.shadow.items():`` around it), the ``if`` that decided, where the collection was filled, whether
    an item went in: an earlier ``if`` in the filling loop whose body ``continue``s (``runs_when``
    False: the item is left out when it is true), or an ``if`` around the filling statement
    (``runs_when`` True). The collection is an attribute of ``self`` (filled anywhere in the file:
    ``self.shadow[k] = ...``, ``self.keys.append(k)``) or a local name filled in the same function.
    Rank tests and settings are passed over, as in ``decision_branch``. Such a decision is made before
    any rank issues the per-item collectives, so no stack at the divergence shows it."""
    for frame in frames(stack):
        defs = [n for n in _function_at(frame.file, frame.line) if not isinstance(n, ast.ClassDef)]
        tree = _tree(frame.file)
        if not defs or tree is None:
            continue
        loops = sorted(
            (
                n
                for n in ast.walk(defs[-1])
                if isinstance(n, (ast.For, ast.AsyncFor)) and n.lineno <= frame.line <= (n.end_lineno or n.lineno)
            ),
            key=lambda n: -n.lineno,
        )
        for loop in loops:
            collection = _collection(loop.iter)
            if collection is None:
                continue
            scope = tree if collection.startswith("self.") else defs[-1]
            branch = _filled_under_if(scope, collection, frame.file, loop)
            if branch is not None:
                return branch
    return None


def _collection(node: ast.expr) -> str | None:
    """``self.shadow`` for ``self.shadow.items()`` / ``sorted(self.shadow)`` / ``list(x.keys())``, ``out``
    for a local name; None for anything else (a call's result, a module's attribute)."""
    while True:
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and not node.args
            and node.func.attr in ("items", "keys", "values")
        ):
            node = node.func.value
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.args
            and node.func.id in ("sorted", "list", "tuple", "enumerate", "reversed")
        ):
            node = node.args[0]
        else:
            break
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return f"self.{node.attr}"
    if isinstance(node, ast.Name):
        return node.id
    return None


_FILLERS = ("append", "add", "setdefault", "insert", "extend", "update")


def _fills(stmt: ast.AST, collection: str) -> bool:
    """Does the statement put an item into ``collection`` (``c[k] = v``, ``c.append(v)``, ...)?"""
    if isinstance(stmt, (ast.Assign, ast.AnnAssign)):
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
        return any(isinstance(t, ast.Subscript) and _segment(t.value) == collection for t in targets)
    for node in ast.walk(stmt):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in _FILLERS
            and _segment(node.func.value) == collection
        ):
            return True
    return False


def _filled_under_if(scope: ast.AST, collection: str, path: str, reader: ast.AST) -> Branch | None:
    for loop in ast.walk(scope):
        if not isinstance(loop, (ast.For, ast.AsyncFor)) or loop is reader:
            continue
        fills = [stmt for stmt in ast.walk(loop) if isinstance(stmt, ast.stmt) and _fills(stmt, collection)]
        if not fills:
            continue
        fill = fills[0]
        guards = []
        for node in ast.walk(loop):
            if not isinstance(node, ast.If) or _configuration(node.test):
                continue
            test = Enclosing("if", path, node.lineno, _segment(node.test))
            if _reads_rank(test):
                continue
            side = _side(node, fill.lineno)
            if side == "body":
                guards.append((node.lineno, Branch(path, node.lineno, test.text, True)))
            elif side == "after" and node.body and isinstance(node.body[-1], ast.Continue) and not node.orelse:
                guards.append((node.lineno, Branch(path, node.lineno, test.text, False)))
        if guards:
            return max(guards, key=lambda g: g[0])[1]  # the nearest to the filling statement
    return None


def _loop_end(function: ast.AST, node: ast.If) -> int | None:
    """The last line of the innermost loop around ``node`` when its body leaves by ``continue`` or
    ``break`` (a rank past that line left the loop: the other side of the branch)."""
    if not node.body or not isinstance(node.body[-1], (ast.Continue, ast.Break)):
        return None
    loops = [
        n
        for n in ast.walk(function)
        if isinstance(n, (ast.For, ast.While, ast.AsyncFor)) and n.lineno < node.lineno <= (n.end_lineno or 0)
    ]
    return max(loops, key=lambda n: n.lineno).end_lineno if loops else None


def _side(node: ast.If, line: int) -> str:
    """Where ``line`` is relative to ``node``: before, test, body, else, after."""
    if line < node.lineno:
        return "before"
    if line > (node.end_lineno or node.lineno):
        return "after"
    if any(s.lineno <= line <= (s.end_lineno or s.lineno) for s in node.body):
        return "body"
    if any(s.lineno <= line <= (s.end_lineno or s.lineno) for s in node.orelse):
        return "else"
    return "test"


def _leaves(body: list[ast.stmt]) -> bool:
    """Does the block end by leaving its loop or function?"""
    return bool(body) and isinstance(body[-1], _EXITS)


def _configuration(test: ast.expr) -> bool:
    """``self.flag``, ``args.apply_fix``, ``not self.agree``: attribute reads with no call or
    comparison (a setting); a name alone is data (``if bad:``)."""
    node = test.operand if isinstance(test, ast.UnaryOp) else test
    return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)


def _schedule(node: ast.If, function: ast.AST) -> bool:
    """A test made only of the counters of the loops around it (``for step in range(...)``, the index
    of ``enumerate``), settings (``cfg.log_every``) and constants: ``(step + 1) % cfg.sync_every == 0``.
    Every rank at that iteration takes the same side: a schedule, not a rank's decision."""
    counters = set()
    for loop in ast.walk(function):
        if not isinstance(loop, ast.For) or not (loop.lineno < node.lineno <= (loop.end_lineno or 0)):
            continue
        call = loop.iter
        if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name):
            continue
        if call.func.id == "range" and isinstance(loop.target, ast.Name):
            counters.add(loop.target.id)
        elif call.func.id == "enumerate" and isinstance(loop.target, ast.Tuple) and loop.target.elts:
            first = loop.target.elts[0]
            if isinstance(first, ast.Name):
                counters.add(first.id)
    if not counters:
        return False

    def invariant(n: ast.AST) -> bool:
        if isinstance(n, ast.Constant):
            return True
        if isinstance(n, ast.Name):
            return n.id in counters
        if isinstance(n, ast.Attribute):
            return isinstance(n.value, ast.Name) and n.value.id not in counters
        if isinstance(n, ast.UnaryOp):
            return invariant(n.operand)
        if isinstance(n, ast.BinOp):
            return invariant(n.left) and invariant(n.right)
        if isinstance(n, ast.BoolOp):
            return all(invariant(v) for v in n.values)
        if isinstance(n, ast.Compare):
            return invariant(n.left) and all(invariant(c) for c in n.comparators)
        return False

    reads_counter = any(isinstance(n, ast.Name) and n.id in counters for n in ast.walk(node.test))
    return reads_counter and invariant(node.test)


#: The calls a test makes when it checks numbers for overflow: torch's and math's own.
_FINITENESS = re.compile(r"\b(isfinite|isnan|isinf|isposinf|isneginf|found_inf)\b")


def checks_finiteness(branch: Branch) -> bool:
    """Does the branch's test check numbers for inf/NaN: directly (``torch.isfinite(norm)``), through a
    name assigned before it in the function (``bad = not math.isfinite(loss)`` then ``if bad:``), or
    through a function or method of the same file that the test calls, or that such an assignment
    calls (``overflow = self.scaler.has_overflow(buf)`` then ``if overflow:``; one level down)?"""
    if _FINITENESS.search(branch.test):
        return True
    try:
        test = ast.parse(branch.test, mode="eval").body
    except SyntaxError:
        return False
    sources = [test]
    for rhs in (rhs for name in _operand_names(test) for rhs in _assigned(branch.file, name, branch.line)):
        if _FINITENESS.search(rhs):
            return True
        try:
            sources.append(ast.parse(rhs, mode="eval").body)
        except SyntaxError:
            continue
    called = {
        n.func.attr if isinstance(n.func, ast.Attribute) else n.func.id
        for source in sources
        for n in ast.walk(source)
        if isinstance(n, ast.Call) and isinstance(n.func, (ast.Attribute, ast.Name))
    }
    tree = _tree(branch.file)
    if tree is None or not called:
        return False
    return any(
        isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
        and n.name in called
        and _FINITENESS.search(ast.unparse(n))
        for n in ast.walk(tree)
    )


_MEANS_FINITE = re.compile(r"\bisfinite\b")
_MEANS_NONFINITE = re.compile(r"\b(isnan|isinf|isposinf|isneginf|found_inf|overflow\w*|has_overflow|nonfinite\w*)\b")


def finite_side(branch: Branch) -> bool | None:
    """Did the ranks whose call is on the branch's side (``runs_when``) see finite numbers? Read from
    the test's polarity: ``isfinite`` means finite, ``isnan`` / ``isinf`` / ``found_inf`` / an
    ``overflow`` mean the opposite, each ``not`` flips it; a name is followed to its assignments
    (those it can read must agree). None where the test does not say (both kinds, or neither, or a
    comparison)."""

    def meaning(text: str) -> bool | None:
        """True: the expression is true when the numbers are finite; False: when they are not."""
        try:
            node = ast.parse(text, mode="eval").body
        except SyntaxError:
            return None
        flips = 0
        while isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            node, flips = node.operand, flips + 1
        if isinstance(node, (ast.Compare, ast.BoolOp)):
            return None  # `found_inf.item() == 0`, `a and not b`: not read
        inner = _segment(node)
        finite, nonfinite = bool(_MEANS_FINITE.search(inner)), bool(_MEANS_NONFINITE.search(inner))
        if finite == nonfinite:
            if isinstance(node, ast.Name):  # one step of data flow; the assignments read must agree
                found = {meaning(rhs) for rhs in _assigned(branch.file, node.id, branch.line)} - {None}
                base = found.pop() if len(found) == 1 else None
                return None if base is None else base if flips % 2 == 0 else not base
            return None
        return finite if flips % 2 == 0 else not finite

    when_true = meaning(branch.test)
    if when_true is None:
        return None
    return when_true if branch.runs_when else not when_true


def overrides_method(path: str, owner: str, method: str) -> int | None:
    """The line of a ``def method`` in a class of ``path`` that subclasses ``owner`` (a base named
    ``owner`` or ``<...>.owner``) and does not call the base's (``super().method`` /
    ``owner.method``): instances of that subclass never run the base class's method, or None."""
    tree = _tree(path)
    if tree is None:
        return None
    for cls in ast.walk(tree):
        if not isinstance(cls, ast.ClassDef):
            continue
        if not any(_segment(base).rsplit(".", 1)[-1] == owner for base in cls.bases):
            continue
        for node in cls.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == method:
                calls_base = any(
                    isinstance(n, ast.Attribute)
                    and n.attr == method
                    and (
                        (isinstance(n.value, ast.Call) and _segment(n.value.func) == "super")
                        or _segment(n.value).rsplit(".", 1)[-1] == owner
                    )
                    for n in ast.walk(node)
                )
                if not calls_base:
                    return node.lineno
    return None


def assigns_attribute(path: str, owner: str, attribute: str) -> int | None:
    """The line where ``path`` assigns ``<...>owner.attribute = ...`` unconditionally (at module level
    or in a function body outside any ``if``: a job replacing a library class's method after import,
    as kernel packages do), or None. An assignment under an ``if`` (``if args.apply_fix:``) may not
    have run and does not count."""
    tree = _tree(path)
    if tree is None:
        return None
    guarded = {
        id(n)
        for branch in ast.walk(tree)
        if isinstance(branch, ast.If)
        for part in (branch.body, branch.orelse)
        for stmt in part
        for n in ast.walk(stmt)
    }
    for node in ast.walk(tree):
        if id(node) in guarded:
            continue
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if (
                    isinstance(t, ast.Attribute)
                    and t.attr == attribute
                    and _segment(t.value).rsplit(".", 1)[-1] == owner
                ):
                    return node.lineno
        elif (
            isinstance(node, ast.Call)
            and _segment(node.func) == "setattr"
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value == attribute
            and _segment(node.args[0]).rsplit(".", 1)[-1] == owner
        ):
            return node.lineno
    return None
