"""An example executor for docs/tools.md: a weather API with a call quota (state across the calls
of an episode) and an error for a city it does not know. data/weather_example.jsonl uses it."""


class Weather:
    def __init__(self, quota=3, cities=None):
        self.quota = quota
        self.cities = cities or {"Paris": [18, "cloudy"], "Rome": [24, "sunny"], "Oslo": [7, "rain"]}

    def forecast(self, city):
        if self.quota == 0:
            raise RuntimeError("quota exceeded")
        self.quota -= 1
        if city not in self.cities:
            raise ValueError(f"unknown city {city!r}")
        temp, sky = self.cities[city]
        return {"city": city, "temp_c": temp, "sky": sky}
