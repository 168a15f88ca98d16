"""What every example shares: where the server is, and its API key if it has one.

DREAMSTAGE_URL (default http://127.0.0.1:8080) and DREAMSTAGE_API_KEY (sent as
`Authorization: Bearer KEY`) are read from the environment.
"""
from __future__ import annotations

import os
from pathlib import Path

from dreamstage.client import Client

HERE = Path(__file__).resolve().parent
URL = os.environ.get("DREAMSTAGE_URL", "http://127.0.0.1:8080")


def client() -> Client:
    key = os.environ.get("DREAMSTAGE_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return Client(URL, timeout=600, headers=headers)
