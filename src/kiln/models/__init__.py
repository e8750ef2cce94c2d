"""Recipes for real models: vision nets, sentence embeddings, LLM decoders. Import torch; not runtime code."""
