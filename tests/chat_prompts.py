"""32 short chat questions, the accuracy and determinism measurements' prompts."""

from __future__ import annotations

from pathlib import Path

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "How many legs does a spider have?",
    "Write a haiku about the sea.",
    "What is 12 times 12?",
    "Who wrote Romeo and Juliet?",
    "Explain photosynthesis in one sentence.",
    "What is the boiling point of water?",
    "Give me a synonym for happy.",
    "What does a compiler do?",
    "Translate 'good morning' to Spanish.",
    "What is the largest planet in the solar system?",
    "Describe a cat in five words.",
    "Why is the sky blue?",
    "List two benefits of exercise.",
    "What is an atom?",
    "Suggest a name for a pet goldfish.",
    "What is the square root of 81?",
    "How do airplanes stay in the air?",
    "What is the opposite of cold?",
    "Write one sentence about autumn.",
    "What language is spoken in Brazil?",
    "What is a prime number?",
    "Recommend a healthy breakfast.",
    "Who painted the Mona Lisa?",
    "What is the freezing point of water in Fahrenheit?",
    "How many continents are there?",
    "What is gravity?",
    "Tell me a fun fact about octopuses.",
    "What is the speed of light?",
    "Define the word 'ephemeral'.",
    "What year did the first person walk on the Moon?",
]


def chat_prompt_ids(model_dir: str | Path, questions: list[str] = QUESTIONS):
    """(tokenizer, the token ids of each question as a one-turn chat with the model's
    template)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, return_dict=True
        )["input_ids"]
        for q in questions
    ]
    return tokenizer, [list(p) for p in prompts]
