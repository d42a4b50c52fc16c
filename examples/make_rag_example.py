"""Writes rag_prompts.parquet beside this file: retrieved passages and questions for rag_job.yaml.

python examples/make_rag_example.py
"""

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

ROWS = [
    (
        "The Eiffel Tower was completed in 1889 for the World's Fair in Paris. It is 330 metres tall.",
        "When was the Eiffel Tower completed?",
        "wiki/eiffel_tower",
    ),
    (
        "Honey bees communicate the direction of flowers with a waggle dance performed inside the hive.",
        "How do honey bees tell each other where flowers are?",
        "wiki/honey_bee",
    ),
    (
        "The Amazon River carries more water than any other river, about 209,000 cubic metres per second.",
        "Which river carries the most water?",
        "wiki/amazon_river",
    ),
    ("Python was created by Guido van Rossum and first released in 1991.", "Who created Python?", "wiki/python"),
    (
        "Mount Kilimanjaro in Tanzania is the highest mountain in Africa, at 5,895 metres.",
        "What is the highest mountain in Africa?",
        "wiki/kilimanjaro",
    ),
    (
        "Photosynthesis turns light, water and carbon dioxide into glucose and oxygen in plant leaves.",
        "What does photosynthesis produce?",
        "wiki/photosynthesis",
    ),
]


def main() -> None:
    table = pa.table(
        {
            "id": [f"rag-{i}" for i in range(len(ROWS))],
            "context": [r[0] for r in ROWS],
            "question": [r[1] for r in ROWS],
            "source": [r[2] for r in ROWS],
        }
    )
    out = Path(__file__).with_name("rag_prompts.parquet")
    pq.write_table(table, out)
    print(f"wrote {table.num_rows} rows to {out}")


if __name__ == "__main__":
    main()
