python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl scratch/tf/*.whl scratch/llg/*.whl >/dev/null 2>&1
[ -d /tmp/site/flashinfer ] || python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site .whl/flashinfer_python-0.3.1.tar.gz >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
