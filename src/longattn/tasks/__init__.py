"""Registered tasks (LRA, forecasting, ...): see :mod:`longattn.tasks.base`. Each module of this
package registers its tasks when the registry is first read."""

from longattn.tasks.base import TASKS, Task, TaskData, get_task, register_task, task_names

__all__ = ["TASKS", "Task", "TaskData", "get_task", "register_task", "task_names"]
