# my_algo.py: python harness.py task=hello algo=custom algo.fn=my_algo:find_best_prompt
from agl import final_reward


async def find_best_prompt(store, task, rows, tasks_per_prompt: int = 4) -> dict:
    """Try every prompt template of the task on the same train tasks; the best mean reward wins."""
    enqueued = {}
    for name, template in task.prompts.items():
        # 1. the template as a new resources version: the agent gets these as keyword arguments
        update = await store.add_resources({**task.resources, "prompt_template": template})
        # 2. the same tasks under each template (all enqueued first: the runners take them together)
        enqueued[name] = [
            (await store.enqueue_rollout(input=row, resources_id=update.resources_id)).rollout_id
            for row in rows[:tasks_per_prompt]
        ]
    scores = {}
    for name, rollout_ids in enqueued.items():
        # 3. wait until the runners have finished them
        await store.wait_for_rollouts(rollout_ids)
        # 4. each rollout's final reward, from its spans (a failed rollout scores 0)
        rewards = []
        for rollout_id in rollout_ids:
            rollout = await store.get_rollout_by_id(rollout_id)
            spans = await store.query_spans(rollout_id, "latest") if rollout.status == "succeeded" else []
            rewards.append(final_reward(spans) or 0.0)
        scores[name] = sum(rewards) / len(rewards)
        print(f"[algo] {name}: mean reward {scores[name]:.3f} over {len(rewards)} tasks")
    # 5. the best template
    best = max(scores, key=scores.get)
    print(f"[algo] best prompt: {best} -> use it with task.prompt={best}")
    return {"best": best, "template": task.prompts[best], "scores": scores, "metrics": {"best_reward": scores[best]}}
