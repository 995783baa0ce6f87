#!/usr/bin/env bash
# The wheels that a GPU machine with only python3, torch and transformers, and no network, needs for the smoke test's
# stages without vLLM (benchmark/gpu_smoke.sh stages 1, 2 and 6). Build them on a machine that reaches PyPI:
#
#   bash benchmark/gpu_wheels.sh [DIR]        # DIR: default benchmark/gpu_wheels/ (git-ignored); about 48 MiB
#
# then carry DIR to the GPU machine and install it there offline, without resolving anything:
#
#   python3 -m pip install --no-deps --no-index DIR/*.whl   # then: python3 -m pip check (names anything still missing)
#   bash benchmark/gpu_smoke.sh --stage 1                     # a stage whose packages are missing says SKIP and which
#
# What goes in: DeepSpeed built here from its source release without pre-built ops (DS_BUILD_OPS=0: a pure-Python
# wheel; ops such as ZeRO-Offload's CPU Adam compile on first use, with the ninja in the bundle), tyro, datasets,
# peft and every package they need that torch and transformers do not already bring (listed below), each at the
# version requirements-cpu.txt pins. Not in it: torch, transformers and their own dependencies (numpy, pydantic,
# huggingface-hub, safetensors, tqdm, pyyaml, ...), which the machine has; vLLM (stages 3-5, 7 and 8), whose wheel
# alone is over 300 MB and pins its own torch; wandb (only --track imports it; WITH_WANDB=1 adds it and its
# packages, 21 MiB more). The compiled wheels are for one Python and one platform: PYTHON_VERSION (default: this
# machine's python3, e.g. 3.11; use the GPU machine's `python3 -V`) and PLATFORM (default: x86_64 Linux, manylinux).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-benchmark/gpu_wheels}
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
PYTHON_VERSION=${PYTHON_VERSION:-$(python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')}
PLATFORM=${PLATFORM:-x86_64}
# What the stages without vLLM import beyond torch and transformers, and what those packages need in turn (found by
# walking their requirements in an environment that has them, less those of torch and transformers).
packages=(
  deepspeed hjson msgpack ninja psutil py-cpuinfo einops            # DeepSpeed (pydantic, numpy, tqdm: transformers')
  tyro docstring_parser typeguard                                   # tyro (the scripts' arguments)
  datasets dill multiprocess pandas pyarrow python-dateutil tzdata xxhash  # datasets (fsspec, filelock: torch's)
  peft accelerate                                                   # peft (--lora-rank)
)
if [ "${WITH_WANDB:-0}" = 1 ]; then
  packages+=(wandb protobuf platformdirs requests urllib3 certifi charset-normalizer sniffio distro httpx httpcore
             cwevals googleapis-common-protos opentelemetry-api opentelemetry-sdk opentelemetry-proto
             opentelemetry-semantic-conventions opentelemetry-exporter-otlp-proto-http
             opentelemetry-exporter-otlp-proto-common opentelemetry-exporter-otlp-common
             opentelemetry-exporter-http-transport)
fi
pinned() {  # pinned <name>: name==version as requirements-cpu.txt pins it (names compared as pip does)
  local want; want=$(echo "$1" | tr 'A-Z_.' 'a-z--')
  local line; line=$(sed 's/#.*//' requirements-cpu.txt | awk -F'==' -v w="$want" '{n = tolower($1); gsub(/[_.]/, "-", n); if (n == w) print $0}')
  [ -n "$line" ] || { echo "error: $1 is not pinned in requirements-cpu.txt" >&2; exit 1; }
  echo "$line" | tr -d ' '
}
pins=()
for name in "${packages[@]:1}"; do pins+=("$(pinned "$name")"); done  # deepspeed (the first) is built below
rm -rf "$out"; mkdir -p "$out"
echo "building $(pinned deepspeed) from its source release (DS_BUILD_OPS=0)"
# --no-binary and --no-cache-dir: a wheel found elsewhere (an index's, pip's cache) may carry pre-built ops
DS_BUILD_OPS=0 "$PYTHON" -m pip wheel --quiet --no-deps --no-binary deepspeed --no-cache-dir -w "$out" "$(pinned deepspeed)"
platforms=()
for tag in manylinux_2_17 manylinux_2_28 manylinux_2_34 manylinux2014; do platforms+=(--platform "${tag}_$PLATFORM"); done
echo "downloading ${#pins[@]} wheels for Python $PYTHON_VERSION, manylinux $PLATFORM"
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PYTHON_VERSION" --implementation cp \
  --abi "cp${PYTHON_VERSION/./}" --abi abi3 --abi none "${platforms[@]}" --platform any -d "$out" "${pins[@]}"
# Trim what no script loads, so that the bundle fits a 64 MiB carry (TRIM=0 keeps every wheel whole): pyarrow's
# headers, sources, tests, Arrow Flight and the S3 library (libarrow_s3: loaded only when S3 is used; libarrow
# needs neither), and the two extra copies of each libarrow_python*.so that a wheel (which holds no links) carries
# beside the one the modules load (.so.NNNN); pandas' tests. Each trimmed wheel's RECORD is rewritten to match.
if [ "${TRIM:-1}" = 1 ]; then
  "$PYTHON" - "$out" <<'EOF'
import base64, glob, hashlib, re, sys, zipfile
drop = {"pyarrow": re.compile(r"pyarrow/(include|src|tests)/|flight|pyarrow/libarrow_s3\.|pyarrow/_pyarrow_cpp_tests"
                              r"|pyarrow/libarrow_python[a-z_]*\.so(\.\d+\.\d+\.\d+)?$"),
        "pandas": re.compile(r"pandas/tests/")}
for name, pattern in drop.items():
    (path,) = glob.glob(f"{sys.argv[1]}/{name}-*.whl")
    with zipfile.ZipFile(path) as whole:
        kept = [(i, whole.read(i)) for i in whole.infolist() if not pattern.search(i.filename)]
        dropped = len(whole.infolist()) - len(kept)
    record = next(i.filename for i, _ in kept if i.filename.endswith(".dist-info/RECORD"))
    lines = [f"{i.filename},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},"
             f"{len(data)}" for i, data in kept if i.filename != record] + [f"{record},,"]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as trimmed:
        for i, data in kept:
            trimmed.writestr(i, "\n".join(lines) + "\n" if i.filename == record else data)
    print(f"trimmed {path}: {dropped} files left out")
EOF
fi
ls -s --block-size=K "$out"
echo "$(ls "$out"/*.whl | wc -l) wheels, $(du -sm "$out" | cut -f1) MiB in $out"
echo "on the GPU machine: python3 -m pip install --no-deps --no-index $out/*.whl && python3 -m pip check"
