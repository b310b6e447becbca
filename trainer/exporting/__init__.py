"""Exports: Hugging Face folders (whole or streamed), a checkpoint's export, and live snapshots."""
