"""Batch evaluation client behind `ktserve eval`.

Sends a dataset to any OpenAI-compatible server (ktserve, vLLM, ...), stores each answer as it arrives,
and scores the answers the way LLaMA-Factory does: BLEU-1..4 and ROUGE-1/2/L over jieba-segmented text,
and accuracy for multiple-choice data.

Modules, in the order data flows through them:
  datasets.py  dataset files (Alpaca / ShareGPT / multiple choice) -> `Sample`s
  client.py    the HTTP side: chat completions, option log-likelihoods, retries
  runner.py    concurrency, progress bar, `results.jsonl` and resume
  metrics.py   per-sample scores (nltk BLEU, rouge-chinese ROUGE, answer-letter extraction)
  report.py    `report.json` / `report.md`, and `--compare`
  cli.py       the `ktserve eval` arguments
"""
