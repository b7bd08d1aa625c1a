#!/usr/bin/env python3
"""A small bag-of-words model trained with sdmha.torch.SparseQueryMultiheadAttention.

Synthetic topics: each of K topics owns a few hundred words of a V-word vocabulary. A document is
T segments; a segment is a bag of words (multi-hot over V, the sparse query row) drawn mostly from
one topic, and its label is that topic. The layer attends from each bag to a learned memory of S
slots (key = value = an nn.Parameter, expanded over the batch: its gradient comes through sdmha's
key/value gradients) and its output projection gives the K topic logits. The loss falls from
ln K towards 0 within a few dozen Adam steps.

    PYTHONPATH=build-py/python python3 examples/python/train_bow.py [--steps 60] [--threads 2]
"""

import argparse
import math
import time

import torch
from torch import nn

from sdmha.torch import SparseQueryMultiheadAttention


class TopicData:
    def __init__(self, vocabulary=8192, topics=8, words_per_topic=300, seed=0):
        generator = torch.Generator().manual_seed(seed)
        self.vocabulary, self.topics = vocabulary, topics
        self.topic_words = torch.stack([torch.randperm(vocabulary, generator=generator)[:words_per_topic]
                                        for _ in range(topics)])
        self.generator = generator

    def batch(self, documents, segments, topic_words=8, noise_words=4):
        """Sparse COO query (documents, segments, V) of word counts, and labels (documents, segments)."""
        g = self.generator
        labels = torch.randint(self.topics, (documents, segments), generator=g)
        rows = documents * segments
        picks = torch.randint(self.topic_words.shape[1], (rows, topic_words), generator=g)
        words = torch.cat([self.topic_words[labels.reshape(-1, 1), picks],
                           torch.randint(self.vocabulary, (rows, noise_words), generator=g)], dim=1)
        row = torch.arange(rows).repeat_interleave(words.shape[1])
        indices = torch.stack([row // segments, row % segments, words.reshape(-1)])
        # Repeated words are duplicate coordinates: the layer sums them (a count).
        values = torch.ones(indices.shape[1])
        query = torch.sparse_coo_tensor(indices, values, (documents, segments, self.vocabulary))
        return query, labels


class BagOfWordsTopics(nn.Module):
    def __init__(self, vocabulary, topics, slots=16, width=32, heads=4, key_dim=16, dropout=0.1, threads=2):
        super().__init__()
        self.memory = nn.Parameter(torch.randn(slots, width) / math.sqrt(width))
        self.attention = SparseQueryMultiheadAttention(heads, key_dim, vocabulary, width, width, output_dim=topics,
                                                       dropout=dropout, num_threads=threads)

    def forward(self, query):
        memory = self.memory.expand(query.shape[0], -1, -1)
        return self.attention(query, memory)  # value = key = memory; logits (B, T, K)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    data = TopicData(seed=args.seed)
    model = BagOfWordsTopics(data.vocabulary, data.topics, threads=args.threads)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    print(f"vocabulary {data.vocabulary}, {data.topics} topics, chance loss ln {data.topics} = "
          f"{math.log(data.topics):.3f}")
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        query, labels = data.batch(documents=16, segments=32)
        logits = model(query)
        loss = nn.functional.cross_entropy(logits.reshape(-1, data.topics), labels.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step == 1 or step % 10 == 0:
            print(f"step {step:4d}  loss {loss.item():.4f}", flush=True)
    model.eval()
    with torch.no_grad():
        query, labels = data.batch(documents=16, segments=32)
        accuracy = (model(query).argmax(-1) == labels).float().mean().item()
    print(f"held-out accuracy {accuracy:.3f} ({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
