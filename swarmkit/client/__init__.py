"""Light client SDK (httpx only; never imports torch)."""
