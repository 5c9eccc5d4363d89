"""agent-lightning's "write your first algorithm", in agl's names: your algorithm as a script of its own,
against the store by URL, while runners on any host run the agent against the policy's route.

    python harness.py algo=store store.port=4747                              # 1. the store
    python harness.py task=hello algo=serve store.url=http://127.0.0.1:4747    # 2. the policy's route
    python harness.py algo=runner store.url=http://127.0.0.1:4747             # 3. runners (more at any time)
    python examples/first_algorithm.py --store http://127.0.0.1:4747          # 4. this algorithm

The algorithm tries each of the task's prompt templates on the same tasks and keeps the best: each template
becomes a resources version (the agent gets its keys as keyword arguments), each task a rollout that names
it, and a rollout's reward comes back from its spans. It calls the store as agent-lightning's examples do
(`agl.SyncStoreClient`, blocking); `agl.StoreClient` has the same methods with `await`. The serving job
publishes its task and route in the store (`run_info["runners"]`): that is how the runners know what to run,
and how this script knows the task's rows and templates.
"""

from __future__ import annotations

import argparse
import json
import time

import agl
from agl.agents.tasks import load_task


def find_best_prompt(store: agl.SyncStoreClient, tasks_per_prompt: int = 4, max_tokens: int = 16) -> dict:
    """Try every prompt template of the served task on the same train tasks; the best mean reward wins."""
    served = store.get_run_info("runners")  # what the serving job published: its task, among others
    if served is None:
        print("[algo] waiting for a job to serve its route (algo=serve publishes it once its model has loaded)")
    while served is None:
        time.sleep(0.5)
        served = store.get_run_info("runners")
    task = load_task(served["task"])
    rows = task.load(served["task"]["train_split"])[:tasks_per_prompt]
    greedy = {"sampling": {"temperature": 0.0, "max_tokens": max_tokens}}  # the agent's llm.sampling_parameters
    enqueued = {}
    for name, template in task.prompts.items():
        # 1. the template as a new resources version: the agent gets these as keyword arguments
        update = store.add_resources({**task.resources, "prompt_template": template})
        # 2. the same tasks under each template (all enqueued first: the runners take them together)
        enqueued[name] = [
            store.enqueue_rollout(input=row, resources_id=update.resources_id, metadata=greedy).rollout_id
            for row in rows
        ]
    scores = {}
    for name, rollout_ids in enqueued.items():
        # 3. wait until the runners have finished them
        finished = store.wait_for_rollouts(rollout_ids)
        # 4. each rollout's final reward, from its spans (a failed rollout scores 0)
        rewards = [
            (agl.final_reward(store.query_spans(r.rollout_id, "latest")) or 0.0) if r.status == "succeeded" else 0.0
            for r in finished
        ]
        scores[name] = sum(rewards) / len(rewards)
        print(f"[algo] {name}: mean reward {scores[name]:.3f} over {len(rewards)} tasks", flush=True)
    # 5. the best template
    best = max(scores, key=scores.get)
    print(f"[algo] best prompt: {best} -> use it with task.prompt={best}", flush=True)
    return {"best": best, "template": task.prompts[best], "scores": scores}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", default="http://127.0.0.1:4747", help="the store's URL (algo=store prints it)")
    parser.add_argument("--api-key", default=None, help="the store's key (store.api_key)")
    parser.add_argument("--tasks-per-prompt", type=int, default=4)
    args = parser.parse_args()
    with agl.SyncStoreClient(args.store, api_key=args.api_key) as store:
        result = find_best_prompt(store, args.tasks_per_prompt)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
