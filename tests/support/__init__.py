"""Helpers the tests share that are not tests: references written from definitions, a GCS
emulator, the trained Harmony model, runners. Importable as `support` from every test folder
(pytest puts tests/, conftest.py's folder, on sys.path)."""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
"""The repository's root."""
