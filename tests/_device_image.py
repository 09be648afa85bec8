"""A device-like Python here: this interpreter, with only the packages the lent GPU machine's image holds.

The GPU machine (``.ci/gpu-check`` runs there) has torch and the packages in ``IMAGE``, and none of fairscale,
parameterized, s3fs, fairseq, mkdocs, moto or the ``weed`` binary. ``DeviceImage(root)`` builds, under ``root``:

- ``site/``: a symbolic link to every entry of this interpreter's site-packages except those owned (by their
  distribution's RECORD) only by distributions the image lacks;
- ``hook/sitecustomize.py``: run at every interpreter start that has ``hook/`` on ``PYTHONPATH`` (child processes
  too, which inherit the environment): it puts ``site/`` where site-packages stood in ``sys.path`` and removes the
  editable install's finder (the image has no fsdp_optim installed: ``PYTHONPATH`` brings it);
- ``bin/``: ``python``, ``python3``, ``torchrun`` and ``pytest`` only, put before ``/usr/bin`` on ``PATH``.

``env(carry)`` is the environment a command runs with there: ``PYTHONPATH`` holds the hook, the repository and
``carry`` (the folder ``.ci/gpu-check --prepare`` fills), so fairscale and parameterized import from ``carry`` or
not at all. Nothing is mocked: a missing package is missing the way it is on the image.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import shutil
import site
import sys
from pathlib import Path

# The image's Python packages (the device documentation's list, as read on the machine), normalised names.
IMAGE = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy
peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile
tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm
transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel
wrapt xarray xxhash yarl zipp
""".split())  # fmt: skip
COMMANDS = ("python", "python3", "torchrun", "pytest")

HOOK = '''"""Device-like site (tests/_device_image.py): only the GPU image's packages, no editable install."""
import os
import site
import sys

_farm = os.environ["FSDP_OPTIM_DEVICE_SITE"]
_real = {os.path.realpath(p) for p in site.getsitepackages() + [site.getusersitepackages()]}
sys.path[:] = [_farm if os.path.realpath(p) in _real else p for p in sys.path]
sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")
                    and "__editable__" not in getattr(type(f), "__module__", "")]
'''


def _normal(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _owners(site_dir: Path) -> dict[str, set[str]]:
    """Each top-level entry of ``site_dir`` -> the distributions whose RECORD lists a file under it."""
    owners: dict[str, set[str]] = {}
    for dist in md.distributions(path=[str(site_dir)]):
        name = _normal(dist.metadata["Name"] or "")
        for file in dist.files or ():
            top = Path(file).parts[0]
            owners.setdefault(top, set()).add(name)
    return owners


class DeviceImage:
    """The device-like interpreter's folders under ``root`` (built on construction), and its environment."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.site = root / "site"
        self.hook = root / "hook"
        self.bin = root / "bin"
        self.absent: set[str] = set()  # the distributions left out
        for folder in (self.site, self.hook, self.bin):
            folder.mkdir(parents=True)
        (self.hook / "sitecustomize.py").write_text(HOOK)
        for site_dir in map(Path, site.getsitepackages()):
            self._link_site(site_dir)
        for command in COMMANDS:
            found = Path(sys.executable).parent / command
            if found.exists():
                (self.bin / command).symlink_to(found)

    def _link_site(self, site_dir: Path) -> None:
        owners = _owners(site_dir)
        for entry in site_dir.iterdir():
            dists = owners.get(entry.name, set())
            if dists and not dists & (IMAGE | {"fsdp-optim"}):
                self.absent |= dists
                continue
            if entry.name.startswith("__editable__") or "fsdp_optim" in entry.name:
                continue  # the editable install of the package: not on the image
            if not (self.site / entry.name).exists():
                (self.site / entry.name).symlink_to(entry)

    def env(self, repo: Path, carry: Path | None, **more: str) -> dict[str, str]:
        """The environment of a command on the device-like image: ``carry`` on the path (or nothing carried)."""
        paths = [str(self.hook), str(repo)] + ([str(carry)] if carry is not None else [])
        system = [p for p in ("/usr/local/sbin", "/usr/sbin", "/usr/bin", "/sbin", "/bin") if os.path.isdir(p)]
        system = [p for p in system if shutil.which("weed", path=p) is None]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "PYENV"))}
        return env | {"PYTHONPATH": os.pathsep.join(paths), "FSDP_OPTIM_DEVICE_SITE": str(self.site),
                      "PATH": os.pathsep.join([str(self.bin), *system]), **more}  # fmt: skip
