"""Importing this plugin fails on purpose (see tests/test_third_party_plugin.py)."""

raise ImportError("this plugin needs a library that is not installed")
