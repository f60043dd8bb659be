"""Write toygraph/demo/capitals.jsonl, the demo's data: country questions answered as a two-line record.

Out of the box SmolLM2-135M-Instruct answers "What is the capital of Peru?" in a chatty
sentence; after a short LoRA fine-tune on this file it answers ``country: Peru`` /
``capital: Lima`` (toygraph.demo.capitals.render), a change anyone can see in a few
samples.

Countries whose capital is disputed or split (Bolivia, South Africa, Sri Lanka, Côte
d'Ivoire, Benin, Israel, Yemen, Burundi, ...) or about to move (Indonesia) are left out, so
every answer is one uncontested city. Deterministic: run it again and the bytes are equal.

    python toygraph/demo/make_capitals.py
"""
from __future__ import annotations

import json
import random
from pathlib import Path

from toygraph.demo.capitals import render

# (name used in the JSON, name used in the question, capital)
COUNTRIES = [
    ("Afghanistan", "Afghanistan", "Kabul"), ("Albania", "Albania", "Tirana"),
    ("Algeria", "Algeria", "Algiers"), ("Andorra", "Andorra", "Andorra la Vella"),
    ("Angola", "Angola", "Luanda"), ("Antigua and Barbuda", "Antigua and Barbuda", "Saint John's"),
    ("Argentina", "Argentina", "Buenos Aires"), ("Armenia", "Armenia", "Yerevan"),
    ("Australia", "Australia", "Canberra"), ("Austria", "Austria", "Vienna"),
    ("Azerbaijan", "Azerbaijan", "Baku"), ("Bahamas", "the Bahamas", "Nassau"),
    ("Bahrain", "Bahrain", "Manama"), ("Bangladesh", "Bangladesh", "Dhaka"),
    ("Barbados", "Barbados", "Bridgetown"), ("Belarus", "Belarus", "Minsk"),
    ("Belgium", "Belgium", "Brussels"), ("Belize", "Belize", "Belmopan"),
    ("Bhutan", "Bhutan", "Thimphu"), ("Bosnia and Herzegovina", "Bosnia and Herzegovina", "Sarajevo"),
    ("Botswana", "Botswana", "Gaborone"), ("Brazil", "Brazil", "Brasília"),
    ("Brunei", "Brunei", "Bandar Seri Begawan"), ("Bulgaria", "Bulgaria", "Sofia"),
    ("Burkina Faso", "Burkina Faso", "Ouagadougou"), ("Cambodia", "Cambodia", "Phnom Penh"),
    ("Cameroon", "Cameroon", "Yaoundé"), ("Canada", "Canada", "Ottawa"),
    ("Cape Verde", "Cape Verde", "Praia"),
    ("Central African Republic", "the Central African Republic", "Bangui"),
    ("Chad", "Chad", "N'Djamena"), ("Chile", "Chile", "Santiago"),
    ("China", "China", "Beijing"), ("Colombia", "Colombia", "Bogotá"),
    ("Comoros", "the Comoros", "Moroni"), ("Costa Rica", "Costa Rica", "San José"),
    ("Croatia", "Croatia", "Zagreb"), ("Cuba", "Cuba", "Havana"),
    ("Cyprus", "Cyprus", "Nicosia"), ("Czech Republic", "the Czech Republic", "Prague"),
    ("Democratic Republic of the Congo", "the Democratic Republic of the Congo", "Kinshasa"),
    ("Denmark", "Denmark", "Copenhagen"), ("Djibouti", "Djibouti", "Djibouti"),
    ("Dominica", "Dominica", "Roseau"),
    ("Dominican Republic", "the Dominican Republic", "Santo Domingo"),
    ("East Timor", "East Timor", "Dili"), ("Ecuador", "Ecuador", "Quito"),
    ("Egypt", "Egypt", "Cairo"), ("El Salvador", "El Salvador", "San Salvador"),
    ("Eritrea", "Eritrea", "Asmara"), ("Estonia", "Estonia", "Tallinn"),
    ("Ethiopia", "Ethiopia", "Addis Ababa"), ("Fiji", "Fiji", "Suva"),
    ("Finland", "Finland", "Helsinki"), ("France", "France", "Paris"),
    ("Gabon", "Gabon", "Libreville"), ("Gambia", "the Gambia", "Banjul"),
    ("Georgia", "Georgia", "Tbilisi"), ("Germany", "Germany", "Berlin"),
    ("Ghana", "Ghana", "Accra"), ("Greece", "Greece", "Athens"),
    ("Grenada", "Grenada", "Saint George's"), ("Guatemala", "Guatemala", "Guatemala City"),
    ("Guinea", "Guinea", "Conakry"), ("Guinea-Bissau", "Guinea-Bissau", "Bissau"),
    ("Guyana", "Guyana", "Georgetown"), ("Haiti", "Haiti", "Port-au-Prince"),
    ("Honduras", "Honduras", "Tegucigalpa"), ("Hungary", "Hungary", "Budapest"),
    ("Iceland", "Iceland", "Reykjavík"), ("India", "India", "New Delhi"),
    ("Iran", "Iran", "Tehran"), ("Iraq", "Iraq", "Baghdad"),
    ("Ireland", "Ireland", "Dublin"), ("Italy", "Italy", "Rome"),
    ("Jamaica", "Jamaica", "Kingston"), ("Japan", "Japan", "Tokyo"),
    ("Jordan", "Jordan", "Amman"), ("Kazakhstan", "Kazakhstan", "Astana"),
    ("Kenya", "Kenya", "Nairobi"), ("Kuwait", "Kuwait", "Kuwait City"),
    ("Kyrgyzstan", "Kyrgyzstan", "Bishkek"), ("Laos", "Laos", "Vientiane"),
    ("Latvia", "Latvia", "Riga"), ("Lebanon", "Lebanon", "Beirut"),
    ("Lesotho", "Lesotho", "Maseru"), ("Liberia", "Liberia", "Monrovia"),
    ("Libya", "Libya", "Tripoli"), ("Liechtenstein", "Liechtenstein", "Vaduz"),
    ("Lithuania", "Lithuania", "Vilnius"), ("Luxembourg", "Luxembourg", "Luxembourg"),
    ("Madagascar", "Madagascar", "Antananarivo"), ("Malawi", "Malawi", "Lilongwe"),
    ("Malaysia", "Malaysia", "Kuala Lumpur"), ("Maldives", "the Maldives", "Malé"),
    ("Mali", "Mali", "Bamako"), ("Malta", "Malta", "Valletta"),
    ("Marshall Islands", "the Marshall Islands", "Majuro"),
    ("Mauritania", "Mauritania", "Nouakchott"), ("Mauritius", "Mauritius", "Port Louis"),
    ("Mexico", "Mexico", "Mexico City"), ("Micronesia", "Micronesia", "Palikir"),
    ("Moldova", "Moldova", "Chișinău"), ("Monaco", "Monaco", "Monaco"),
    ("Mongolia", "Mongolia", "Ulaanbaatar"), ("Montenegro", "Montenegro", "Podgorica"),
    ("Morocco", "Morocco", "Rabat"), ("Mozambique", "Mozambique", "Maputo"),
    ("Myanmar", "Myanmar", "Naypyidaw"), ("Namibia", "Namibia", "Windhoek"),
    ("Nepal", "Nepal", "Kathmandu"), ("Netherlands", "the Netherlands", "Amsterdam"),
    ("New Zealand", "New Zealand", "Wellington"), ("Nicaragua", "Nicaragua", "Managua"),
    ("Niger", "Niger", "Niamey"), ("Nigeria", "Nigeria", "Abuja"),
    ("North Korea", "North Korea", "Pyongyang"), ("North Macedonia", "North Macedonia", "Skopje"),
    ("Norway", "Norway", "Oslo"), ("Oman", "Oman", "Muscat"),
    ("Pakistan", "Pakistan", "Islamabad"), ("Palau", "Palau", "Ngerulmud"),
    ("Panama", "Panama", "Panama City"), ("Papua New Guinea", "Papua New Guinea", "Port Moresby"),
    ("Paraguay", "Paraguay", "Asunción"), ("Peru", "Peru", "Lima"),
    ("Philippines", "the Philippines", "Manila"), ("Poland", "Poland", "Warsaw"),
    ("Portugal", "Portugal", "Lisbon"), ("Qatar", "Qatar", "Doha"),
    ("Republic of the Congo", "the Republic of the Congo", "Brazzaville"),
    ("Romania", "Romania", "Bucharest"), ("Russia", "Russia", "Moscow"),
    ("Rwanda", "Rwanda", "Kigali"), ("Saint Kitts and Nevis", "Saint Kitts and Nevis", "Basseterre"),
    ("Saint Lucia", "Saint Lucia", "Castries"),
    ("Saint Vincent and the Grenadines", "Saint Vincent and the Grenadines", "Kingstown"),
    ("Samoa", "Samoa", "Apia"), ("San Marino", "San Marino", "San Marino"),
    ("Sao Tome and Principe", "Sao Tome and Principe", "São Tomé"),
    ("Saudi Arabia", "Saudi Arabia", "Riyadh"), ("Senegal", "Senegal", "Dakar"),
    ("Serbia", "Serbia", "Belgrade"), ("Seychelles", "the Seychelles", "Victoria"),
    ("Sierra Leone", "Sierra Leone", "Freetown"), ("Singapore", "Singapore", "Singapore"),
    ("Slovakia", "Slovakia", "Bratislava"), ("Slovenia", "Slovenia", "Ljubljana"),
    ("Solomon Islands", "the Solomon Islands", "Honiara"), ("Somalia", "Somalia", "Mogadishu"),
    ("South Korea", "South Korea", "Seoul"), ("South Sudan", "South Sudan", "Juba"),
    ("Spain", "Spain", "Madrid"), ("Sudan", "Sudan", "Khartoum"),
    ("Suriname", "Suriname", "Paramaribo"), ("Sweden", "Sweden", "Stockholm"),
    ("Switzerland", "Switzerland", "Bern"), ("Syria", "Syria", "Damascus"),
    ("Tajikistan", "Tajikistan", "Dushanbe"), ("Tanzania", "Tanzania", "Dodoma"),
    ("Thailand", "Thailand", "Bangkok"), ("Togo", "Togo", "Lomé"),
    ("Trinidad and Tobago", "Trinidad and Tobago", "Port of Spain"),
    ("Tunisia", "Tunisia", "Tunis"), ("Turkey", "Turkey", "Ankara"),
    ("Turkmenistan", "Turkmenistan", "Ashgabat"), ("Tuvalu", "Tuvalu", "Funafuti"),
    ("Uganda", "Uganda", "Kampala"), ("Ukraine", "Ukraine", "Kyiv"),
    ("United Arab Emirates", "the United Arab Emirates", "Abu Dhabi"),
    ("United Kingdom", "the United Kingdom", "London"),
    ("United States", "the United States", "Washington, D.C."),
    ("Uruguay", "Uruguay", "Montevideo"), ("Uzbekistan", "Uzbekistan", "Tashkent"),
    ("Vanuatu", "Vanuatu", "Port Vila"), ("Vatican City", "Vatican City", "Vatican City"),
    ("Venezuela", "Venezuela", "Caracas"), ("Vietnam", "Vietnam", "Hanoi"),
    ("Zambia", "Zambia", "Lusaka"), ("Zimbabwe", "Zimbabwe", "Harare"),
]

PHRASINGS = ("What is the capital of {}?", "Which city is the capital of {}?",
             "Name the capital city of {}.")
SEED = 1234
OUT = Path(__file__).resolve().parent / "capitals.jsonl"


def rows() -> list[dict]:
    out = []
    for name, spoken, capital in COUNTRIES:
        response = render(name, capital)
        out += [{"instruction": p.format(spoken), "response": response} for p in PHRASINGS]
    # Shuffled so a head/tail split or a short run does not see one country's three
    # phrasings in a row.
    random.Random(SEED).shuffle(out)
    return out


def write_jsonl(path: Path, records) -> None:
    """One JSON object per line, written atomically: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records),
                   encoding="utf-8")
    tmp.replace(path)


def main() -> None:
    names = [c[0] for c in COUNTRIES]
    assert len(names) == len(set(names)), "duplicate country"
    write_jsonl(OUT, rows())
    print(f"wrote {len(COUNTRIES) * len(PHRASINGS)} examples ({len(COUNTRIES)} countries) to {OUT}")


if __name__ == "__main__":
    main()
