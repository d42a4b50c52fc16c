"""Writes sample_prompts.parquet beside this file: the embedded default job's 36 chat prompts.

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

# Read-and-answer prompts of a few hundred tokens: past the 128 full-precision tokens, most of their cache lives in
# the 2-bit store, so the default job's stats show the compression (short prompts never leave full precision).
PASSAGES = [
    (
        "The town of Wrenfield voted last spring to turn its old railway depot into a public library. The depot had "
        "been empty since 1987, when the branch line closed, and for years the council debated whether to sell the "
        "land to a supermarket chain. Residents collected more than four thousand signatures asking for a library "
        "instead. The renovation kept the brick walls, the iron roof trusses and the clock above the main door, "
        "which had stopped at twenty past nine on the day the last train left. Architects added a glass reading "
        "room where the platform used to be, with long tables facing the old tracks, now planted with wildflowers. "
        "The children's section sits in the former ticket hall, and the stationmaster's office became a quiet room "
        "for people who work from home. The project cost 3.2 million pounds: half came from a national heritage "
        "grant, a third from the council, and the rest from local businesses and a bake sale that ran every Saturday "
        "for two years. The library opened in September with eleven thousand books, a repair café on the first "
        "Sunday of each month, and the clock, restored by a retired watchmaker, running again.",
        "Where did the money for the renovation come from? Answer in one sentence.",
    ),
    (
        "Return policy. Items bought in our shops or online may be returned within 30 days of delivery for a full "
        "refund, provided they are unused and in their original packaging. Sale items may be returned within 14 "
        "days and are refunded as store credit, not money. Personalised goods, opened software, underwear and "
        "perishable food cannot be returned unless they arrive damaged or faulty. To return an online order, start "
        "the return from your account page: you will receive a prepaid label by email, valid for seven days. Returns "
        "made in a shop are refunded at the till to the original payment card; returns sent by post are refunded "
        "within five working days of reaching our warehouse. If an item arrives damaged, photograph it and the "
        "packaging and contact us within 48 hours; we will send a replacement at no cost or refund the delivery "
        "charge as well as the item. Gift receipts allow the person who received the gift to exchange it or get "
        "store credit, but never a cash refund. Large furniture is collected from your home for a fee of 25 euros, "
        "which is waived if the furniture is faulty.",
        "I bought a discounted lamp ten days ago and want to return it. What will I get back?",
    ),
    (
        "Lab note, week 12. This week we repeated the germination trial with the three bean varieties, this time "
        "keeping the trays at a constant 22 degrees instead of the room's daily swing between 16 and 27 degrees. "
        "Each variety had four trays of 25 seeds, watered with 40 millilitres every morning. The red variety "
        "sprouted first, on day three, and reached 92 percent germination by day seven, up from 71 percent in the "
        "first trial. The speckled variety improved less, from 64 to 70 percent, and two of its trays grew a white "
        "mould on day five, which we removed; those trays were counted but flagged. The black variety was the "
        "surprise: it barely changed, 88 percent in both trials, which suggests it tolerates temperature swings "
        "well. Next week we will test whether the speckled variety's mould comes from the seed batch or the trays, "
        "by sterilising half of the trays and splitting a fresh seed packet between sterilised and plain trays. We "
        "also need a second thermometer: the incubator's display and our handheld reading differed by 1.5 degrees "
        "on Wednesday.",
        "Which bean variety gained most from the constant temperature, and by how much?",
    ),
    (
        "Meeting notes, product team, Tuesday. Attendees: Priya (chair), Tomasz, Aiko, Daniel, Mbali. First item, "
        "the mobile app release: testing found a crash when users rotate the screen during checkout. Tomasz has a "
        "fix but wants one more day of testing, so the release moves from Thursday to Friday morning. Second item, "
        "the survey results: 1,240 customers answered, and the most requested feature is a dark mode, followed by "
        "saved shopping lists and a faster search. Aiko pointed out that dark mode is mostly design work and could "
        "ship in the next release, while saved lists need changes to the database. The team agreed to start on "
        "dark mode first. Third item, hiring: Daniel has interviewed four candidates for the data analyst role and "
        "will invite two back for a second interview next week; Mbali will join those interviews. Fourth item, the "
        "office move: the new office will not be ready until the end of next month because of delays with the "
        "electrical work, so the team stays where it is until then. Actions: Tomasz to finish the crash fix, Aiko "
        "to draft dark mode designs, Daniel to schedule second interviews, Priya to update the release calendar.",
        "List who is responsible for each action from the meeting.",
    ),
]


def main() -> None:
    rows = [(category, text) for category, texts in PROMPTS.items() for text in texts]
    rows += [("read", f"Read the text below, then answer.\n\n{passage}\n\nQuestion: {question}")
             for passage, question in PASSAGES]
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
