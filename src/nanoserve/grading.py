"""Which implementation a stage's graded tests run against: the reference, the starter, or yours.

Introduced in stage 00. A stage's API is the set of public names its `starter.py` defines; the
stage's recipe maps the same names to the reference objects (`learner_api.py` imports them), so
any of them can stand in for the others. It loads implementations and nothing more (refusing
one whose every API name is the reference's own object): running the tests is
`nanoserve.check`'s job.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.util
import os
import sys
import traceback
import types
from pathlib import Path

from nanoserve.learner_api import has_learner_api, learner_api
from nanoserve.stages import STAGES, Stage, get_stage

IMPL_ENV_VAR = "NANOSERVE_IMPL"  # carries --impl to subprocesses and pytest-xdist workers
DEFAULT_IMPL = "ref"


class ImplementationError(ImportError):
    """An --impl value that cannot be loaded, or a module that lacks part of the stage API."""


def repo_root() -> Path:
    """The checkout that holds `stages/`: the package's own (editable install), else the cwd's."""
    package_checkout = Path(__file__).resolve().parents[2]
    for candidate in (package_checkout, Path.cwd(), *Path.cwd().parents):
        if (candidate / "stages").is_dir():
            return candidate
    raise FileNotFoundError("no stages/ folder found: run from a nanoserve checkout")


def stage_for_path(path: str | os.PathLike) -> Stage:
    """The stage whose folder (stages/NN_slug) holds this file, by the manifest's stems."""
    folder = Path(path).resolve().parent.name
    for stage in STAGES:
        if stage.stem == folder:
            return stage
    stems = ", ".join(s.stem for s in STAGES)
    raise ValueError(f"{path} is not inside a stage folder (one of: {stems})")


def api_names(stage_number: int) -> list[str]:
    """The public names a stage's implementation must define."""
    if not has_learner_api(stage_number):
        stage = get_stage(stage_number)
        raise ValueError(f"stage {stage_number} ({stage.stem}) has no graded learner API yet")
    return list(learner_api(stage_number))


def starter_names(stage_number: int) -> list[str]:
    """The public functions and classes that a stage's starter.py defines itself: its API."""
    module = _module_from_file(repo_root() / get_stage(stage_number).starter)
    return [
        name
        for name, value in vars(module).items()
        if not name.startswith("_")
        and isinstance(value, (type, types.FunctionType))
        and value.__module__ == module.__name__
    ]


def is_path_like(impl: str) -> bool:
    """True when --impl names a file rather than `ref`, `starter` or a dotted module."""
    return impl.endswith(".py") or "/" in impl or os.sep in impl


def normalize_impl(impl: str | None, base: str | os.PathLike | None = None) -> str:
    """`ref` when unset; a file path made absolute (so subprocesses agree); others unchanged."""
    impl = (impl or DEFAULT_IMPL).strip()
    if not is_path_like(impl):
        return impl
    path = Path(impl).expanduser()
    if not path.is_absolute():
        path = Path(base or Path.cwd()) / path
    return str(path.resolve())


def load_impl(
    stage_number: int, impl: str = DEFAULT_IMPL, base: str | os.PathLike | None = None
) -> types.SimpleNamespace:
    """The stage API from `ref`, `starter`, a .py path or a dotted module, as a namespace.

    A relative path is taken from `base`: a folder, or a file whose folder is meant, so a
    learner's file can load its neighbour wherever pytest runs:
    `load_impl(2, "my_allocator.py", base=__file__)`. Without `base`, from the working directory.
    """
    names = api_names(stage_number)
    if impl == "ref":
        return types.SimpleNamespace(**learner_api(stage_number))
    if impl == "starter":
        module = _module_from_file(repo_root() / get_stage(stage_number).starter)
    else:
        module = import_impl(impl, base)
    missing = [n for n in names if not hasattr(module, n)]
    if missing:
        stage = get_stage(stage_number)
        raise ImplementationError(
            f"--impl {impl} does not define {', '.join(missing)}; stage {stage.stem} needs every "
            f"name its starter defines ({', '.join(names)}). Copy {stage.starter} and fill it in."
        )
    api = {n: getattr(module, n) for n in names}
    _refuse_the_reference(stage_number, impl, api)
    _refuse_inherited_tasks(stage_number, impl, api)
    return types.SimpleNamespace(**api)


def reference_module(obj: object) -> str | None:
    """The nanoserve module that defines obj (the reference's own object), else None."""
    module = getattr(obj, "__module__", None) or ""
    return module if module == "nanoserve" or module.startswith("nanoserve.") else None


def _refuse_the_reference(stage_number: int, impl: str, api: dict[str, object]) -> None:
    """ImplementationError, one line, when every API object is the reference's own: such a
    file (`from nanoserve... import *`) would have the reference graded in its author's name."""
    homes = {name: reference_module(obj) for name, obj in api.items()}
    if not all(homes.values()):
        return
    stage = get_stage(stage_number)
    name = next(iter(api))
    raise ImplementationError(
        f"--impl {impl} defines none of stage {stage.stem}'s API itself: {name} is the "
        f"reference's own ({homes[name]}.{name}), and so is every other name. Copy "
        f"{stage.starter} and fill it in."
    )


def starter_classes(stage_number: int) -> dict[str, tuple[set[str], list[str]]]:
    """Per class of the stage's starter: (the names of its bases, the methods it defines: the
    learner's tasks), read from its syntax tree (importing the starter is not needed)."""
    tree = ast.parse((repo_root() / get_stage(stage_number).starter).read_text())
    return {
        node.name: (
            {b.id for b in node.bases if isinstance(b, ast.Name)},
            [f.name for f in node.body if isinstance(f, ast.FunctionDef)],
        )
        for node in tree.body
        if isinstance(node, ast.ClassDef)
    }


def _refuse_inherited_tasks(stage_number: int, impl: str, api: dict[str, object]) -> None:
    """ImplementationError, one line, when a class whose starter subclasses its own reference
    answer (stages 11 and 12 subclass the one Scheduler, which holds every stage's answer) takes
    from the reference (by inheriting it, or by assigning it) a method the starter asks the
    learner to write: it would be graded without being written."""
    reference = learner_api(stage_number)
    for name, (bases, methods) in starter_classes(stage_number).items():
        cls = api.get(name)
        if getattr(reference.get(name), "__name__", None) not in bases:
            continue  # the starter's class does not build on its own answer
        if not isinstance(cls, type) or reference_module(cls):
            continue  # the reference's own class, named as the API: _refuse_the_reference's
        for method in methods:
            owner = next((c for c in cls.__mro__ if method in vars(c)), None)
            code = None if owner is None else vars(owner)[method]
            if code is not None and reference_module(code):
                raise ImplementationError(
                    f"--impl {impl}: {name}.{method} is the reference's "
                    f"({code.__module__}.{code.__qualname__}); write it in {name} (a task of "
                    f"{get_stage(stage_number).starter})"
                )


def import_impl(impl: str, base: str | os.PathLike | None = None) -> types.ModuleType:
    """The module a .py path or a dotted name names, imported once (not `ref` or `starter`,
    which need a stage); ImplementationError, one line, when it cannot be imported."""
    if is_path_like(impl):
        return _module_from_file(Path(normalize_impl(impl, base=_folder_of(base))))
    return _import_module(impl)


def stages_named_by(args: list[str], base: str | os.PathLike) -> list[Stage]:
    """The stages whose folder (or a file in it) a pytest command line names, in order:
    `stages/07_prefix_cache` and `stages/07_prefix_cache/test_07_prefix_cache.py::test_x` both
    name stage 07."""
    by_stem = {stage.stem: stage for stage in STAGES}
    named = []
    for arg in args:
        path = Path(base, arg.split("::")[0]).resolve()
        stage = by_stem.get(path.name if path.is_dir() else path.parent.name)
        if stage is not None and stage not in named:
            named.append(stage)
    return sorted(named, key=lambda stage: stage.number)


def _folder_of(base: str | os.PathLike | None) -> Path | None:
    """base itself when it is a folder; the folder holding it when it names a file."""
    if base is None:
        return None
    base = Path(base).expanduser().resolve()
    return base if base.is_dir() else base.parent


def _import_module(name: str) -> types.ModuleType:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name != name.split(".")[0] and err.name != name:
            raise ImplementationError(f"--impl {name} failed to import: {err}") from err
        raise ImplementationError(
            f"--impl {name}: no module of that name (expected ref, starter, a path to a .py "
            f"file, or an importable dotted module name)"
        ) from err
    except Exception as err:
        raise ImplementationError(f"--impl {name} failed to import: {_one_line(err)}") from err


def _module_from_file(path: Path) -> types.ModuleType:
    if not path.is_file():
        raise ImplementationError(f"--impl {path}: no such file")
    # A name unique to the path, so two stages' starter.py files never collide in sys.modules.
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    name = f"nanoserve_impl_{path.stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImplementationError(f"--impl {path}: not a Python source file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before exec: dataclasses and pickling look the module up
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[name]
        where = _where_in(err, path)
        raise ImplementationError(
            f"--impl {path} failed to import: {_one_line(err)}{where}"
        ) from err
    return module


def _one_line(err: Exception) -> str:
    return f"{type(err).__name__}: {err}".splitlines()[0]


def _where_in(err: Exception, path: Path) -> str:
    """' (line N of file.py)': the last line of the learner's file the error passed through."""
    lines = [f.lineno for f in traceback.extract_tb(err.__traceback__) if f.filename == str(path)]
    if not lines or isinstance(err, SyntaxError):  # a SyntaxError names its line itself
        return ""
    return f" (line {lines[-1]} of {path.name})"
