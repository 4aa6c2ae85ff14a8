"""Test setup: no network on CI, so every hub and Flower network feature is switched off here."""

import os

for _key in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "FLWR_DISABLE_UPDATE_CHECK"):
    os.environ[_key] = "1"
os.environ["FLWR_TELEMETRY_ENABLED"] = "0"
os.environ.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")
