"""Writes the compiled core's type stub, cartridges_core.pyi, into the folder given (`make
stubs` writes python/; tests/test_core_stub.py checks that file is current).

pybind11-stubgen reads the built module; two things are set right after it: enums are found
in the module itself, and the module's own classes are named bare (pybind11 writes an
optional return as `cartridges_core.User | None`, which a stub cannot resolve)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch  # noqa: F401  (loads libtorch before the compiled core)
import pybind11_stubgen


def main(out_dir: str) -> None:
    pybind11_stubgen.main(["cartridges_core", "-o", out_dir, "--exit-code",
                           "--enum-class-locations", "Priority:cartridges_core",
                           "--enum-class-locations", "Composition:cartridges_core"])
    stub = Path(out_dir) / "cartridges_core.pyi"
    stub.write_text(stub.read_text().replace("cartridges_core.", ""))


if __name__ == "__main__":
    main(sys.argv[1])
