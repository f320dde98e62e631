"""Test doubles that are worth shipping: a fake OpenAI-compatible streaming server."""
