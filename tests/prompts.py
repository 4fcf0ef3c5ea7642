"""Prompts shared by the SmolLM2 tests (exports, packs and plans must agree on the same ones)."""

SMOLLM2_PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about autumn leaves.",
    "Explain what a neural network is to a ten-year-old.",
]
