"""The typed schema (Hydra's ConfigStore), its cross-field checks, the one compose, and the generated reference
(docs/config.md)."""
