"""kvbridge KV connector for vLLM (uses the vLLM and torch already installed)."""
