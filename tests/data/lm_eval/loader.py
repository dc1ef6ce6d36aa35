"""`custom_dataset` for the colibri lm-eval tasks: the JSONL files next to this one, read without
the Hugging Face hub or the `datasets` cache (the task YAMLs name it with `!function loader.load`)."""
import json
from pathlib import Path


def load(data_file: str, **_metadata):
    import datasets

    rows = [json.loads(line) for line in (Path(__file__).parent / data_file).read_text().splitlines() if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
