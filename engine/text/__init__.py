"""Text in and out: chat templates to token ids, incremental detokenizing, tool-call formats."""
