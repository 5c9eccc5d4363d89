"""The secret words of twenty questions, by category. Written for agl (MIT, as the repository):
common concrete nouns a small model knows, one word each, singular."""
from __future__ import annotations

NOUNS: dict[str, tuple[str, ...]] = {
    "animal": ("cat", "dog", "horse", "cow", "lion", "tiger", "elephant", "rabbit", "monkey", "bear", "sheep", "wolf", "mouse", "giraffe", "zebra", "fox"),
    "bird": ("eagle", "owl", "penguin", "parrot", "duck", "chicken", "swan", "crow", "pigeon", "flamingo", "ostrich", "robin", "goose", "hawk", "peacock", "sparrow"),
    "fruit": ("apple", "banana", "orange", "grape", "lemon", "cherry", "strawberry", "pear", "peach", "mango", "pineapple", "watermelon", "plum", "kiwi", "coconut", "lime"),
    "vegetable": ("carrot", "potato", "onion", "tomato", "cabbage", "lettuce", "broccoli", "pepper", "cucumber", "garlic", "pumpkin", "spinach", "pea", "corn", "celery", "radish"),
    "vehicle": ("car", "bus", "bicycle", "train", "truck", "airplane", "boat", "motorcycle", "helicopter", "ship", "taxi", "scooter", "tractor", "submarine", "rocket", "van"),
    "musical instrument": ("piano", "guitar", "violin", "drum", "flute", "trumpet", "harp", "saxophone", "cello", "clarinet", "trombone", "banjo", "accordion", "harmonica", "ukulele", "tuba"),
    "kitchen item": ("spoon", "fork", "knife", "plate", "cup", "bowl", "pan", "kettle", "oven", "toaster", "fridge", "blender", "teapot", "ladle", "whisk", "jar"),
    "piece of furniture": ("chair", "table", "bed", "sofa", "desk", "shelf", "wardrobe", "stool", "bench", "dresser", "cabinet", "couch", "bookcase", "cradle", "hammock", "armchair"),
    "tool": ("hammer", "saw", "screwdriver", "wrench", "drill", "shovel", "axe", "pliers", "ladder", "rake", "chisel", "scissors", "tape", "ruler", "brush", "file"),
    "piece of clothing": ("shirt", "hat", "shoe", "sock", "coat", "dress", "skirt", "scarf", "glove", "jacket", "sweater", "boot", "belt", "tie", "jeans", "vest"),
}
