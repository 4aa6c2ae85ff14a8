"""Test setup: no network on CI, so every hub and Flower network feature is switched off here."""

import atexit
import os
import shutil
import tempfile

for _key in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "FLWR_DISABLE_UPDATE_CHECK"):
    os.environ[_key] = "1"
os.environ["FLWR_TELEMETRY_ENABLED"] = "0"
os.environ.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")
# Partitions drawn by the tests (and by the Flower runs they start) go to a folder of this
# session, not to ~/.cache/fedact.
os.environ["FEDACT_CACHE_DIR"] = tempfile.mkdtemp(prefix="fedact-test-cache-")
atexit.register(shutil.rmtree, os.environ["FEDACT_CACHE_DIR"], ignore_errors=True)
