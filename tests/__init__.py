"""Tests of afkmemory."""
