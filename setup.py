"""The native core's build (C++17, pybind11); everything else about the package is in pyproject.toml.

``kvlife.lifecycle.native._core`` is compiled from ``lifecycle/native/src/*.cpp`` with the
system C++ compiler. A machine without one still installs kvlife: the failure is written to
``_core_build_error.txt`` beside where the module would be, and ``kvlife run`` says in its
header that it runs the Python engine and why (``kvlife.lifecycle.native.why_not``).

Environment: ``KVLIFE_NATIVE_SANITIZE=1`` builds with AddressSanitizer and UBSan (CI runs
the differential suite under such a build); ``KVLIFE_NATIVE_REQUIRED=1`` makes a failed
build fail the install (``.ci/run`` sets it); ``KVLIFE_NATIVE_JOBS=N`` compiles N units at
once (default: one per CPU).
"""

from __future__ import annotations

import os
from glob import glob
from pathlib import Path

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension
from setuptools import setup
from setuptools.command.build_ext import build_ext

NAME = "kvlife.lifecycle.native._core"
ERROR_FILE = "_core_build_error.txt"


class OptionalBuildExt(build_ext):
    """Builds the native core; a failure becomes a note, not a failed install."""

    failed: dict[str, str]

    def build_extension(self, ext):  # type: ignore[no-untyped-def]
        self.failed = getattr(self, "failed", {})
        error_file = Path(self.get_ext_fullpath(ext.name)).with_name(ERROR_FILE)
        try:
            super().build_extension(ext)
        except Exception as exc:  # no compiler, a compile error: the Python engine runs
            if os.environ.get("KVLIFE_NATIVE_REQUIRED") == "1":
                raise
            reason = " ".join(str(exc).split()) or type(exc).__name__
            self.failed[ext.name] = f"{type(exc).__name__}: {reason}\n"
            error_file.parent.mkdir(parents=True, exist_ok=True)
            error_file.write_text(self.failed[ext.name])
            print(f"kvlife: the native core was not built ({reason}); the Python engine will run")
        else:
            error_file.unlink(missing_ok=True)

    def copy_extensions_to_source(self) -> None:
        """An editable install: the module goes beside the sources, or (its build failed)
        the note saying why, and no stale module from an earlier build stays."""
        super().copy_extensions_to_source()
        build_py = self.get_finalized_command("build_py")
        for ext in self.extensions:
            inplace = Path(self._get_inplace_equivalent(build_py, ext)[0])
            note = inplace.with_name(ERROR_FILE)
            if ext.name in getattr(self, "failed", {}):
                inplace.unlink(missing_ok=True)
                note.write_text(self.failed[ext.name])
            else:
                note.unlink(missing_ok=True)


def _flags() -> tuple[list[str], list[str]]:
    # Bit-identical floating point with CPython: no contraction into FMA, no fast-math.
    compile_args = ["-ffp-contract=off", "-fno-fast-math"]
    link_args: list[str] = []
    if os.environ.get("KVLIFE_NATIVE_SANITIZE") == "1":
        sanitize = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer"]
        compile_args += [*sanitize, "-O1", "-g"]
        link_args += sanitize
    else:
        compile_args += ["-O2"]
    return compile_args, link_args


compile_args, link_args = _flags()
# One compiler process per CPU (``KVLIFE_NATIVE_JOBS=N`` to choose): the core is some thirty
# translation units, and a serial build of them takes minutes on a two-core machine.
ParallelCompile("KVLIFE_NATIVE_JOBS", default=0).install()
setup(
    ext_modules=[
        Pybind11Extension(
            NAME,
            sorted(glob("lifecycle/native/src/*.cpp")),
            include_dirs=["lifecycle/native/src"],
            depends=sorted(glob("lifecycle/native/src/*.hpp")),
            cxx_std=17,
            extra_compile_args=compile_args,
            extra_link_args=link_args,
            optional=os.environ.get("KVLIFE_NATIVE_REQUIRED") != "1",
        )
    ],
    cmdclass={"build_ext": OptionalBuildExt},
)
