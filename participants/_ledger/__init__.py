"""The capture ledger: file-backed and in-memory ledgers, lineage resolution and the ledger control routes."""
