"""Writes sample_prompts.parquet beside this file: the embedded default job's 32 chat prompts.

python pipeline/data/make_sample_prompts.py
"""

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

PROMPTS = {
    "explain": [
        "Explain in two sentences why the sky is blue.",
        "What does a compiler do? Answer briefly.",
        "Explain what a hash table is to a new programmer.",
        "Why do we have leap years?",
        "What is the difference between RAM and disk storage?",
        "How does a refrigerator keep food cold?",
        "What is photosynthesis, in one paragraph?",
        "Why does ice float on water?",
    ],
    "howto": [
        "How do I boil an egg so the yolk stays soft?",
        "Give three tips for writing a clear email.",
        "How can I make my houseplants live longer?",
        "What are the steps to change a flat bicycle tire?",
        "How should I prepare for a job interview?",
        "How do I start learning to play the guitar?",
        "Suggest a simple weekly routine for staying fit at home.",
        "How do I back up the photos on my phone?",
    ],
    "write": [
        "Write a haiku about autumn rain.",
        "Write a short thank-you note to a colleague who helped me move.",
        "Write a two-line poem about the ocean.",
        "Describe a cozy coffee shop in three sentences.",
        "Write a friendly reminder that the team meeting moved to Friday.",
        "Write a one-sentence story about a lost key.",
        "Give a catchy name for a bakery that sells only bread.",
        "Write a limerick about a cat who loves boxes.",
    ],
    "facts": [
        "What is the capital of Australia?",
        "Name the planets of the solar system in order.",
        "Who wrote 'Pride and Prejudice'?",
        "How many bones are in the adult human body?",
        "What is the boiling point of water at sea level in Fahrenheit?",
        "Which ocean is the largest?",
        "What language is spoken in Brazil?",
        "What gas do plants absorb from the air?",
    ],
}


def main() -> None:
    rows = [(category, text) for category, texts in PROMPTS.items() for text in texts]
    table = pa.table(
        {
            "id": [f"sample-{i:02d}" for i in range(len(rows))],
            "messages": [[{"role": "user", "content": text}] for _, text in rows],
            "category": [category for category, _ in rows],
        }
    )
    out = Path(__file__).with_name("sample_prompts.parquet")
    pq.write_table(table, out)
    print(f"wrote {table.num_rows} prompts to {out}")


if __name__ == "__main__":
    main()
